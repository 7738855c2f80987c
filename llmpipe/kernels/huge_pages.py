"""Large CPU tensors on transparent huge pages: what a decode step streams (weights, the KV cache, the
batched kernels' panels).

Batch-1 decode reads every weight once a token. On 4 KiB pages Gemma 3's 190 MB LM head spans 46,000
pages: a TLB miss each, and the hardware prefetchers stop at every page boundary. On 2 MiB pages the
same stream runs near the machine's read bandwidth (Gemma 3 270M, Zen 4, 2 threads: the head 8.1 →
6.9 ms; a decode step 16.7–18.4 → 12.8–14.2 ms).

Linux backs anonymous memory with huge pages where THP is `always`, or — a common default — `madvise`,
for ranges advised MADV_HUGEPAGE. PyTorch's CPU allocator advises only under THP_MEM_ALLOC_ENABLE=1,
read once at its first allocation (too early for a library to set), so these tensors are allocated
here: an anonymous mapping (zero-filled), advised, wrapped by torch.frombuffer (the tensor keeps the
mapping alive). Where the advice does not exist or THP is `never`, the mapping is ordinary memory.
"""

from __future__ import annotations

import math
import mmap

import torch
from torch import nn

MIN_BYTES = 2 << 20  # one huge page: smaller tensors stay with PyTorch's allocator


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A zeroed tensor; on the CPU, on huge-page-advised memory when it spans at least one huge page."""
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel * dtype.itemsize < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a shared anonymous mapping is shmem, whose huge pages follow another switch (often off)
    mapping = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:  # a kernel without THP: ordinary pages
            pass
    return torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)


PAGE_BYTES = 4096


def fault_in(tensor: torch.Tensor) -> None:
    """Take a fresh zeros() tensor's pages now, one write of its own zeros a 4 KiB page: a first write
    to a huge page costs the kernel a 2 MiB allocation and clearing (~2 ms on this VM; 1 GiB of KV
    cache ~1.1 s) that otherwise lands in whichever engine step first reaches the page. Only for a
    tensor still all zeros: what it holds is overwritten with zeros."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return
    flat = tensor.view(-1)
    flat[:: max(1, PAGE_BYTES // tensor.element_size())].zero_()


def moved(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself if small or not on the CPU, else a copy on huge-page-advised memory."""
    return zeros(tensor.shape, tensor.dtype).copy_(tensor) if _large_cpu(tensor) else tensor


def _large_cpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() >= MIN_BYTES


def place_weights(model: nn.Module, fresh: bool = False) -> None:
    """Give every large CPU parameter and buffer of a freshly allocated (`to_empty`) model huge-page
    memory, before its weights are copied in; a tensor shared by several modules stays shared.
    `fresh`: the new memory stays untouched zeros instead of a copy of the old values (`to_empty`'s
    are garbage), so a page becomes resident only when a weight is written to it."""
    place = (lambda t: zeros(t.shape, t.dtype) if _large_cpu(t) else t) if fresh else moved
    replaced: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        param.data = place(param.data)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = replaced.setdefault(id(buffer), place(buffer))
