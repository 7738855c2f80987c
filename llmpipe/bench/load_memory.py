"""Load time and memory of `llmpipe.LLM(path)`, each run in a fresh process.

    python -m llmpipe.bench.load_memory FILE.gguf [FILE.gguf ...] [--runs 2] [--kv-cache-memory 256MiB]
    llmpipe bench load FILE.gguf ...

Reports load seconds, peak RSS (ru_maxrss and VmHWM), RSS after load (and its anonymous / file-backed
parts), each also as a ratio to the file's size (the machine may be shared: ratios travel, seconds less
so). With --phases, VmRSS is sampled every 20 ms labelled by the loader phase (and tensor) it fell in,
and the highest sample per phase is printed: where the peak comes from.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

GiB = 2**30
SAMPLE_S = 0.02


def status_kib(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in KiB (VmRSS, VmHWM, RssAnon, RssFile)."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                values[name] = int(rest.split()[0])
    return values


class PhaseSampler:
    """VmRSS every SAMPLE_S seconds, the highest sample kept per phase label."""

    def __init__(self) -> None:
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PhaseSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            rss = status_kib("VmRSS")["VmRSS"] * 1024
            phase = self.phase
            self.peaks[phase] = max(self.peaks.get(phase, 0), rss)

    def labelled(self, label: str, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            previous, self.phase = self.phase, label
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = previous
        return wrapper


def _instrument(sampler: PhaseSampler) -> None:
    """Label the loader's phases: checkpoint parsing, each tensor's conversion, the KV pool."""
    from llmpipe.engine import core
    from llmpipe.loader import checkpoint

    core.load_checkpoint = sampler.labelled("parse GGUF + tokenizer", core.load_checkpoint)
    core.load_model = sampler.labelled("build model", core.load_model)
    core.ModelRunner = sampler.labelled("KV pool + runner", core.ModelRunner)
    iter_weights = checkpoint.Checkpoint.iter_weights

    def labelled_weights(self, *args: Any, **kwargs: Any):
        for name, tensor in iter_weights(self, *args, **kwargs):
            sampler.phase = "weights: " + name.replace("model.layers.", "L")
            yield name, tensor
        sampler.phase = "after weights"

    checkpoint.Checkpoint.iter_weights = labelled_weights


def measure(path: str, kv_cache_memory: str, phases: bool) -> dict[str, Any]:
    """One load in this process (call in a fresh one)."""
    return measure_load(path, kv_cache_memory, phases)[1]


def measure_load(path: str, kv_cache_memory: str, phases: bool = False, **engine_options: Any) -> tuple[Any, dict[str, Any]]:
    """One load in this process (call in a fresh one) and the engine it loaded, for a benchmark that
    goes on to run it (`llmpipe bench realsize`)."""
    import llmpipe

    sampler = PhaseSampler()
    if phases:
        _instrument(sampler)
    with sampler:
        start = time.perf_counter()
        llm = llmpipe.LLM(path, kv_cache_memory=kv_cache_memory, progress=False, **engine_options)
        seconds = time.perf_counter() - start
    after = status_kib("VmRSS", "VmHWM", "RssAnon", "RssFile")
    result = {
        "file": path,
        "file_bytes": os.path.getsize(path),
        "load_s": seconds,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "vm_hwm": after["VmHWM"] * 1024,
        "rss_after": after["VmRSS"] * 1024,
        "anon_after": after["RssAnon"] * 1024,
        "file_rss_after": after["RssFile"] * 1024,
        "weight_bytes": llm.engine.weight_bytes,
    }
    if phases:
        result["phase_peaks"] = sampler.peaks
    return llm, result


def run_fresh(path: str, kv_cache_memory: str, phases: bool) -> dict[str, Any]:
    command = [sys.executable, "-m", "llmpipe.bench.load_memory", "--child", path, "--kv-cache-memory", kv_cache_memory]
    if phases:
        command.append("--phases")
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def report(results: list[dict[str, Any]]) -> str:
    head = (f"{'file':<28} {'GiB':>5} {'load s':>7} {'peak GiB':>9} {'peak/file':>9} {'after GiB':>9} "
            f"{'after/file':>10} {'anon':>6} {'filemap':>7}")
    rows = [head]
    for r in results:
        size = r["file_bytes"]
        peak = max(r["ru_maxrss"], r["vm_hwm"])
        rows.append(
            f"{Path(r['file']).name:<28} {size / GiB:>5.2f} {r['load_s']:>7.1f} {peak / GiB:>9.2f} {peak / size:>9.2f} "
            f"{r['rss_after'] / GiB:>9.2f} {r['rss_after'] / size:>10.2f} {r['anon_after'] / GiB:>6.2f} "
            f"{r['file_rss_after'] / GiB:>7.2f}"
        )
    return "\n".join(rows)


def phase_report(result: dict[str, Any], top: int = 8) -> str:
    peaks = sorted(result["phase_peaks"].items(), key=lambda kv: -kv[1])[:top]
    return "\n".join(f"  {rss / GiB:6.2f} GiB  {phase}" for phase, rss in peaks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", help="GGUF files (or any model llmpipe.LLM loads)")
    parser.add_argument("--runs", type=int, default=2, help="fresh processes per file")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--phases", action="store_true", help="also sample VmRSS by loader phase (20 ms)")
    parser.add_argument("--output", default=None, help="also write the results as JSON")


def main(args: argparse.Namespace) -> None:
    results = []
    for path in args.files:
        for _ in range(args.runs):
            results.append(run_fresh(path, args.kv_cache_memory, args.phases))
            if args.phases:
                print(f"{Path(path).name}: highest VmRSS per phase\n{phase_report(results[-1])}", flush=True)
    print(report(results))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.child:
        print(json.dumps(measure(parsed.files[0], parsed.kv_cache_memory, parsed.phases)))
    else:
        main(parsed)
