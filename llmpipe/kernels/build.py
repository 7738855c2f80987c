"""Building and loading llmpipe's C kernels (`csrc/`) as the torch ops `torch.ops.llmpipe.*`, once per build.

Each C source (`csrc/*.c`) is compiled to an object with the C compiler (FLAGS); then
torch.utils.cpp_extension compiles `csrc/ops.cpp` — the ops' schemas (`TORCH_LIBRARY`, marking what
each writes in place) and one CPU wrapper per op that checks its inputs and calls the C entry point —
and links it with the objects into one library, which it loads. It all lives in a folder named by a
hash of every csrc file, the flags, the compilers' and PyTorch's versions, so a change to any of
them builds anew. cpp_extension's lock file lets one process build a folder while others wait; the
objects are written under per-process names and renamed, so no process reads a half-written one.

Every way this can fail — no AVX2, no compiler, a compiler that exits with an error, no ninja, no
writable build folder, a library that does not load — logs one warning and `library()` returns None,
and the callers take their PyTorch paths. The result is cached per process, so a failure costs one
attempt, never one per decode step.

The library links libgomp by the soname of PyTorch's own copy, which is loaded first, so the kernels'
threads are PyTorch's (torch.set_num_threads, OMP_NUM_THREADS). Each op is one dispatcher call into
its C++ wrapper; its fake implementation (`fake.py`) lets torch.compile trace it as an opaque op.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils import cpp_extension

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
OPS_SOURCE = "ops.cpp"
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC")  # the C kernels' (F16C: every AVX2 CPU has it)
CXX_FLAGS = ("-O2",)  # ops.cpp's (argument checks and calls only)
LINK_FLAGS = ("-fopenmp", "-lm")

_loaded: Path | None = None  # the library this process has loaded: it cannot be unloaded, nor another loaded


class KernelBuildError(Exception):
    """Why the kernels are not used (logged once, never raised to a caller)."""


@functools.cache
def library() -> torch._ops._OpNamespace | None:
    """torch.ops.llmpipe with the kernels loaded (built first where needed), or None after one warning."""
    try:
        _load()
    except Exception as err:  # noqa: BLE001 - whatever fails (compilers, ninja, cpp_extension, the loader) falls back
        logger.warning("llmpipe's C kernels are not used, PyTorch computes their ops instead: %s", err)
        return None
    return torch.ops.llmpipe


def _load() -> None:
    global _loaded
    compiler = _c_compiler()
    path = library_path(compiler)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    objects = [_compile(compiler, source, path.parent) for source in sorted(CSRC.glob("*.c"))]
    if _loaded == path:
        return
    if _loaded is not None:
        raise KernelBuildError(f"{_loaded} is loaded in this process already; a new build loads in a new one")
    _build_and_load(path, objects)
    _loaded = path
    from llmpipe.kernels import fake  # noqa: F401 - the ops' fake implementations (ops.cpp names this module)


def _c_compiler() -> str:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise KernelBuildError("this CPU has no AVX2 + FMA")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelBuildError("no C compiler (cc or gcc) on PATH")
    return compiler


def _build_and_load(path: Path, objects: list[Path]) -> None:
    """ops.cpp linked with the C objects into `path` (unless ninja finds it up to date), then loaded."""
    try:
        with _interpreter_bin_on_path():
            cpp_extension.load(
                name=path.stem, sources=[str(CSRC / OPS_SOURCE)], extra_cflags=list(CXX_FLAGS),
                extra_ldflags=[*map(str, objects), *LINK_FLAGS], build_directory=str(path.parent),
                is_python_module=False, verbose=False,
            )
    except RuntimeError as err:  # no ninja, or the build failed (the message holds ninja's whole log)
        raise KernelBuildError(_first_error(str(err))) from None
    except OSError as err:
        raise KernelBuildError(f"{path} was not built or does not load ({err.__cause__ or err})") from None


def library_path(compiler: str) -> Path:
    """The library's path, in a folder named like it: a hash of every csrc file, the flags, the C and
    C++ compilers' versions, PyTorch's version, the interpreter's ABI tag and the build folder (so
    that one name is never built with two sets of arguments, which cpp_extension would rename)."""
    folder, key = build_dir(), hashlib.sha256()
    sources = sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h", ".cpp"))  # any may include any header
    parts = [part for p in sources for part in (p.name.encode(), p.read_bytes())]
    parts += [" ".join(FLAGS + CXX_FLAGS + LINK_FLAGS).encode(), compiler_version(compiler),
              compiler_version(cpp_extension.get_cxx_compiler()), torch.__version__.encode(),
              sys.implementation.cache_tag.encode(), str(folder).encode()]
    for part in parts:
        key.update(part)
        key.update(b"\0")
    name = f"llmpipe_ops_{key.hexdigest()[:16]}"
    return folder / name / f"{name}.so"


@functools.cache
def compiler_version(compiler: str) -> bytes:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelBuildError(f"{compiler} --version failed: {err}") from None
    if done.returncode != 0:
        raise KernelBuildError(f"{compiler} --version exited with status {done.returncode}")
    return done.stdout


def build_candidates() -> list[Path]:
    """Build folders in order of preference: beside the sources (a development checkout), then a
    per-user cache, then a per-user folder in the system temp directory."""
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return [CSRC / "_build", Path.home() / ".cache" / "llmpipe" / "kernels",
            Path(tempfile.gettempdir()) / f"llmpipe-kernels-{user}"]


def build_dir() -> Path:
    for folder in build_candidates():
        if _usable_dir(folder):
            return folder
    raise KernelBuildError("no writable build folder among " + ", ".join(map(str, build_candidates())))


def _usable_dir(folder: Path) -> bool:
    """An existing or new folder that this user owns (not a link) and may write to."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.is_symlink() or not os.access(folder, os.W_OK | os.X_OK):
            return False
        return not hasattr(os, "getuid") or folder.stat().st_uid == os.getuid()
    except OSError:
        return False


def _compile(compiler: str, source: Path, folder: Path) -> Path:
    """source's object file in `folder` (compiled unless it is there)."""
    target = folder / f"{source.stem}.o"
    if target.exists():
        return target
    logger.info("compiling %s", source.name)
    partial = target.with_suffix(f".{os.getpid()}.tmp")  # per process: concurrent first uses never share it
    command = [compiler, *FLAGS, "-c", f"-I{CSRC}", str(source), "-o", str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelBuildError(f"{compiler} failed to run: {err}") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise KernelBuildError(f"{compiler} exited with status {done.returncode}: {last}")
    partial.replace(target)  # atomic: concurrent builders never link a half-written file
    return target


@contextlib.contextmanager
def _interpreter_bin_on_path() -> Iterator[None]:
    """PATH led by the interpreter's bin folder while cpp_extension runs: it looks for ninja on PATH
    only, a venv's python run by its path does not have that folder on PATH, and `pip install ninja`
    (a dependency) puts ninja there. First, so that one ninja builds every time: a ninja of another
    version rewrites the build log and rebuilds ops.cpp."""
    previous = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), previous or os.defpath])
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = previous


def _first_error(build_log: str) -> str:
    """cpp_extension's message, cut to its first line and the compiler's first error."""
    lines = [line.strip() for line in build_log.splitlines() if line.strip()] or ["no message"]
    errors = [line for line in lines[1:] if "error" in line.lower()]
    head = lines[0].split(": [", 1)[0]  # ninja's log follows on the first line: "[1/2] c++ ..."
    return head if not errors else f"{head}: {errors[0]}"


def reset() -> None:
    """Forget the attempt (for tests that change the compiler or the build folder); a library loaded
    already stays loaded."""
    library.cache_clear()
    compiler_version.cache_clear()
