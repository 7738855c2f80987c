"""A C kernel that cannot be built or loaded — a compiler that fails, no writable build folder, a
corrupt library — costs one warning and one attempt; every caller then gets the PyTorch path's
exact outputs, and the decode step never sees an exception."""

from __future__ import annotations

import logging
import os
import stat
from types import SimpleNamespace

import pytest
import torch

from llmpipe.kernels import build
from llmpipe.layers import attention_kernel, small_batch
from llmpipe.layers.attention import decode_attention
from llmpipe.layers.linear import linear
from llmpipe.quant import kernels as lowbit
from llmpipe.quant.linear import Int4Linear, Int8Linear

LIBRARIES = (lowbit._library, small_batch._library, attention_kernel._library)


@pytest.fixture(autouse=True)
def fresh_loads():
    """Every test starts and ends with nothing loaded, so later tests load the real kernels again."""
    build.reset_all()
    yield
    build.reset_all()


def kernel_outputs() -> list[torch.Tensor]:
    """One call into each kernel's entry point: INT4 and INT8 decode rows, a small float batch,
    decode attention over a paged float32 cache."""
    torch.manual_seed(0)
    outs = []
    for layer_type, group in ((Int4Linear, 32), (Int8Linear, None)):
        layer = layer_type(64, 96, False, group)
        layer.load_shard(None, torch.randn(96, 64))
        outs.append(layer(torch.randn(1, 64)))
    outs.append(linear(torch.randn(4, 96), torch.randn(200, 96), torch.randn(200)))
    kv_cache = torch.randn(2, 8, 4, 2, 16)
    meta = SimpleNamespace(decode_block_tables=torch.tensor([[3, 5, 1], [0, 2, 7]]),
                           decode_context_lens=torch.tensor([10, 7]), decode_max_len=10, decode_same_len=False)
    outs.append(decode_attention(torch.randn(2, 6, 16), kv_cache, meta, 0.25, None))
    return outs


def pytorch_outputs(monkeypatch) -> list[torch.Tensor]:
    with monkeypatch.context() as m:
        m.setattr(lowbit, "available", lambda: False)
        m.setattr(small_batch, "usable", lambda x, weight: False)
        m.setattr(attention_kernel, "usable", lambda q, kv_cache: False)
        return kernel_outputs()


def assert_falls_back(monkeypatch, caplog, reason: str) -> None:
    expected = pytorch_outputs(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        for _ in range(2):  # a second use neither retries nor warns again
            for got, want in zip(kernel_outputs(), expected, strict=True):
                assert torch.equal(got, want)
    assert all(library() is None for library in LIBRARIES)
    warnings = [r.getMessage() for r in caplog.records if r.name == build.__name__]
    assert len(warnings) == len(LIBRARIES), warnings
    assert all(reason in w for w in warnings), warnings


def test_the_kernels_build_and_load_on_this_machine():
    """CI machines have a compiler and AVX2: if this fails, decode silently loses its kernels."""
    assert all(library() is not None for library in LIBRARIES)


def test_a_compiler_that_fails_falls_back_to_pytorch(tmp_path, monkeypatch, caplog):
    fake = tmp_path / "cc"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "fake-cc 0.1"; exit 0; }\n'
                    'echo "fake-cc: internal compiler error" >&2\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert_falls_back(monkeypatch, caplog, "internal compiler error")


def test_no_writable_build_folder_falls_back_to_pytorch(tmp_path, monkeypatch, caplog):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setattr(build, "build_candidates", lambda: [not_a_folder / "kernels"])
    assert_falls_back(monkeypatch, caplog, "no writable build folder")


def test_a_corrupt_library_falls_back_to_pytorch(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(build, "build_candidates", lambda: [tmp_path / "kernels"])
    compiler = build.shutil.which("cc") or build.shutil.which("gcc")
    for name in ("lowbit_linear", "small_batch_linear", "paged_attention"):
        build.library_path(build.CSRC / f"{name}.c", compiler).write_bytes(b"\x7fELF but not really")
    assert_falls_back(monkeypatch, caplog, "does not load")


def test_the_build_is_named_by_source_flags_and_compiler_version(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "build_candidates", lambda: [tmp_path])
    source, compiler = build.CSRC / "paged_attention.c", build.shutil.which("cc") or build.shutil.which("gcc")
    first = build.library_path(source, compiler)
    monkeypatch.setattr(build, "FLAGS", (*build.FLAGS, "-DEXTRA"))
    with_flags = build.library_path(source, compiler)
    monkeypatch.setattr(build, "compiler_version", lambda _: b"another compiler 99")
    with_compiler = build.library_path(source, compiler)
    assert len({first, with_flags, with_compiler}) == 3


def test_the_fallback_build_folder_is_per_user_and_refused_if_another_user_owns_it(tmp_path):
    assert str(os.getuid()) in build.build_candidates()[-1].name
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    if os.getuid() != 0:
        pytest.skip("only root can make a folder another user owns")
    os.chown(theirs, 12345, 12345)
    assert not build._usable_dir(theirs)
    assert build._usable_dir(tmp_path / "mine")
