"""Large CPU tensors on huge-page-advised memory: zeroed, writable, shared where the model shares them,
and, where the kernel offers transparent huge pages, actually backed by them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from llmpipe.kernels import huge_pages

BIG = huge_pages.MIN_BYTES // 4 * 3  # float32 elements: 1.5 huge pages


def smaps_kib(address: int, field: str = "AnonHugePages") -> int:
    """A field (kB) of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def test_large_zeros_are_zeroed_writable_tensors_of_their_own_mapping():
    t = huge_pages.zeros((BIG // 64, 64), torch.float32)
    assert t.shape == (BIG // 64, 64) and t.dtype == torch.float32 and not t.any()
    t[3, 5] = 7.0
    assert t.sum() == 7.0
    small = huge_pages.zeros((10, 10), torch.int8)
    assert small.dtype == torch.int8 and not small.any()


def test_moved_copies_large_tensors_and_keeps_small_ones():
    small, large = torch.randn(100), torch.randn(BIG)
    assert huge_pages.moved(small) is small
    copy = huge_pages.moved(large)
    assert copy.data_ptr() != large.data_ptr() and torch.equal(copy, large)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(1, 1), nn.Linear(1, 1)
        self.a.weight = nn.Parameter(torch.randn(BIG // 16, 16))
        self.b.weight = self.a.weight  # one parameter, two modules
        shared = torch.randn(BIG)
        self.a.register_buffer("codes", shared)
        self.b.register_buffer("codes", shared)
        self.a.register_buffer("none", None)


def test_placing_a_models_weights_keeps_what_it_shares_shared_and_small_tensors_alone():
    model = Tied()
    weight, codes, bias = model.a.weight.detach().clone(), model.a.codes.clone(), model.a.bias.data_ptr()
    huge_pages.place_weights(model)
    assert model.a.weight is model.b.weight and model.a.codes is model.b.codes and model.a.none is None
    assert torch.equal(model.a.weight, weight) and torch.equal(model.a.codes, codes)
    assert model.a.bias.data_ptr() == bias  # 4 bytes: PyTorch's allocator


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
    reason="the kernel offers no transparent huge pages",
)
def test_where_the_kernel_offers_huge_pages_a_large_tensor_gets_them():
    t = huge_pages.zeros((64 << 20,), torch.uint8)
    t.fill_(1)  # fault every page in
    assert smaps_kib(t.data_ptr()) >= 2048
    plain = torch.ones(64 << 20, dtype=torch.uint8)  # PyTorch's allocator, not advised (THP `madvise`)
    if "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert smaps_kib(plain.data_ptr()) < smaps_kib(t.data_ptr())


def test_faulting_in_makes_every_page_resident_and_keeps_the_zeros():
    """fault_in takes a fresh mapping's pages before any step writes them (a KV cache at server start)."""
    tensor = huge_pages.zeros((4 * BIG,), torch.float32)
    address, size_kib = tensor.data_ptr(), tensor.numel() * 4 // 1024
    assert smaps_kib(address, "Rss") < size_kib // 2  # a fresh anonymous mapping: not yet taken
    huge_pages.fault_in(tensor)
    assert smaps_kib(address, "Rss") >= size_kib
    assert not tensor.any()
