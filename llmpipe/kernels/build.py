"""Compiling and loading llmpipe's C kernels (`csrc/`), once per source, flags and compiler.

Every way this can fail — no AVX2, no compiler, a compiler that exits with an error, no writable
build folder, a library that does not load — logs one warning and returns None, and the caller
takes its PyTorch path. The result (a library or None) is cached per source, so a failure costs one
attempt per process, never one per decode step.

Libraries share PyTorch's OpenMP runtime (the same libgomp soname), so their threads are PyTorch's.
Each kernel's Python entry point is registered as a torch op (`torch.ops.llmpipe.*`, `kernel_op`):
one dispatcher call (~4 us) taking tensors, with a schema that says what it writes in place.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
I64, PTR = ctypes.c_int64, ctypes.c_void_p


_OPS = torch.library.Library("llmpipe", "FRAGMENT")


def kernel_op(schema: str):
    """Register the decorated CPU implementation as the torch op llmpipe::<name> (`schema` in
    torch.library's syntax: `Tensor(a!)` for what it writes in place) and return the op."""

    def register(implementation):
        name = schema.split("(", 1)[0]
        _OPS.define(schema)
        _OPS.impl(name, implementation, "CPU")
        return getattr(torch.ops.llmpipe, name)

    return register


class KernelBuildError(Exception):
    """Why a kernel is not used (logged once, never raised to a caller)."""


class KernelLibrary:
    """One C source's library (csrc/`name`.c), built and loaded on first call; None after one warning
    when that cannot be done here. `signatures` gives each function its ctypes argument types."""

    instances: list[KernelLibrary] = []

    def __init__(self, name: str, **signatures: list) -> None:
        self.name, self.signatures = name, signatures
        self._library: ctypes.CDLL | None = None
        self._tried = False
        KernelLibrary.instances.append(self)

    def __call__(self) -> ctypes.CDLL | None:
        if not self._tried:  # checked on every kernel call: kept to one attribute read
            self._library, self._tried = self._load(), True
        return self._library

    def _load(self) -> ctypes.CDLL | None:
        try:
            library = _load(CSRC / f"{self.name}.c")
            for function, argtypes in self.signatures.items():
                getattr(library, function).argtypes = argtypes
        except (KernelBuildError, OSError, AttributeError) as err:
            logger.warning("the %s kernel is not used, PyTorch computes it instead: %s", self.name, err)
            return None
        return library

    def reset(self) -> None:
        self._library, self._tried = None, False


def _load(source: Path) -> ctypes.CDLL:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise KernelBuildError("this CPU has no AVX2 + FMA")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelBuildError("no C compiler (cc or gcc) on PATH")
    library = library_path(source, compiler)
    if not library.exists():
        _compile(compiler, source, library)
    torch.ones(1).sum()  # make sure PyTorch's OpenMP runtime is loaded first, so the library binds to it
    try:
        return ctypes.CDLL(str(library))
    except OSError as err:
        raise KernelBuildError(f"{library} does not load ({err}); delete it to rebuild") from None


def library_path(source: Path, compiler: str) -> Path:
    """Where the build of `source` by `compiler` lives: named by a hash of the source, the shared
    headers, the flags and the compiler's version, so a change to any of them builds anew."""
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]  # any kernel may include any of them
    for part in (source.read_bytes(), *headers, " ".join(FLAGS).encode(), compiler_version(compiler)):
        key.update(part)
        key.update(b"\0")
    return build_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


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


def _compile(compiler: str, source: Path, library: Path) -> None:
    logger.info("compiling %s", source.name)
    partial = library.with_suffix(f".{os.getpid()}.tmp")  # per process: concurrent first uses never share it
    command = [compiler, *FLAGS, f"-I{CSRC}", str(source), "-o", str(partial), "-lm"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernelBuildError(f"{compiler} failed to run: {err}") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise KernelBuildError(f"{compiler} exited with status {done.returncode}: {last}")
    partial.replace(library)  # atomic: concurrent builders never load a half-written file


def reset_all() -> None:
    """Forget every load (for tests that change the compiler or the build folder)."""
    for library in KernelLibrary.instances:
        library.reset()
    compiler_version.cache_clear()
