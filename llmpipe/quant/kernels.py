"""The low-bit decode kernels (csrc/lowbit_linear.c), compiled on first use and called via ctypes.

PyTorch 2.13's CPU low-bit kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) are
fast on this kind of CPU only with bfloat16 activations, and return bfloat16: measured on
SmolLM2 that moves greedy decoding off the float model's tokens at a step where the float
top-2 margin is 0.017. These kernels keep activations, scales and accumulation in float32.
The library shares PyTorch's OpenMP runtime (same libgomp soname), so its threads are PyTorch's.
Without a C compiler or AVX2 + FMA, `available()` is False and layers dequantize instead.
`compile_library` builds the other C kernels too (`llmpipe.layers.attention_kernel`).
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

SOURCE = Path(__file__).parent / "csrc" / "lowbit_linear.c"
SHARED_HEADER = Path(__file__).parents[1] / "csrc" / "simd.h"  # included by every kernel; part of the build hash
MAX_ROWS = 8  # rows per call (csrc MAX_ROWS)
CHUNK = 32  # K (padded) and group sizes are multiples of this
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def compile_library(source: Path) -> ctypes.CDLL | None:
    """C source compiled (once per content) with AVX2 + FMA + OpenMP and loaded; None without AVX2
    or a C compiler (callers then take their PyTorch path)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.warning("no AVX2 on this CPU: %s is not used", source.name)
        return None
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: %s is not used", source.name)
        return None
    code = source.read_bytes() + SHARED_HEADER.read_bytes()
    library = _build_dir() / f"{source.stem}-{hashlib.sha256(code).hexdigest()[:16]}.so"
    if not library.exists():
        _compile(compiler, source, library)
    torch.ones(1).sum()  # make sure PyTorch's OpenMP runtime is loaded first, so the library binds to it
    return ctypes.CDLL(str(library))


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = compile_library(SOURCE)
    if lib is not None:
        lib.int4_linear.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
        lib.int8_linear.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
    return lib


def _build_dir() -> Path:
    here = SOURCE.parent / "_build"
    try:
        here.mkdir(exist_ok=True)
        return here
    except OSError:  # a read-only install
        fallback = Path(tempfile.gettempdir()) / "llmpipe-kernels"
        fallback.mkdir(exist_ok=True)
        return fallback


def _compile(compiler: str, source: Path, library: Path) -> None:
    logger.info("compiling %s", source.name)
    partial = library.with_suffix(f".{os.getpid()}.tmp")  # per process: concurrent first uses never share it
    command = [compiler, "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", f"-I{SHARED_HEADER.parent}",
               str(source), "-o", str(partial), "-lm"]
    subprocess.run(command, check=True, capture_output=True)
    partial.replace(library)  # atomic: concurrent builders never load a half-written file


def available() -> bool:
    return _library() is not None


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] float32 contiguous → [M, N] float32."""
    y = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    _library().int4_linear(
        x.data_ptr(), codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), y.data_ptr(),
        x.shape[0], codes.shape[0], x.shape[1], group,
    )
    return y


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    _library().int8_linear(
        x.data_ptr(), codes.data_ptr(), scale.data_ptr(), y.data_ptr(), x.shape[0], codes.shape[0], x.shape[1], group
    )
    return y
