"""The C kernels' extension that cannot be built or loaded — a compiler that fails, no writable build
folder, no ninja, a library that does not load, a second build in one process — costs one warning
and one attempt; every caller then gets the PyTorch path's exact outputs, and the decode step never
sees an exception."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmpipe.kernels import build
from llmpipe.layers import attention_kernel, small_batch
from llmpipe.layers.attention import decode_attention
from llmpipe.layers.linear import linear
from llmpipe.kernels import ops as lowbit
from llmpipe.quant.linear import Int4Linear, Int8Linear

COMPILER = shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(autouse=True)
def fresh_loads():
    """Every test starts and ends with no attempt made, so later tests load the real kernels again."""
    build.reset()
    yield
    build.reset()


@pytest.fixture
def as_a_new_process(tmp_path, monkeypatch):
    """No library loaded yet, the build folder empty and the C objects taken as compiled (the tests
    that use this fail later, at ninja or the loader)."""
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setattr(build, "build_candidates", lambda: [tmp_path / "kernels"])
    monkeypatch.setattr(build, "_compile", lambda compiler, source, folder: folder / f"{source.stem}.o")


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
    assert build.library() is None
    assert not lowbit.available() and not lowbit.dot_available() and lowbit.dot_isas() == [0]
    warnings = [r.getMessage() for r in caplog.records if r.name == build.__name__]
    assert len(warnings) == 1, warnings
    assert reason in warnings[0], warnings


def test_the_kernels_build_and_load_on_this_machine():
    """CI machines have a compiler, ninja and AVX2: if this fails, decode silently loses its kernels."""
    assert build.library() is torch.ops.llmpipe
    assert lowbit.available() and lowbit.dot_available()
    assert build.library_path(COMPILER).exists()


def test_a_compiler_that_fails_falls_back_to_pytorch(tmp_path, monkeypatch, caplog):
    fake = tmp_path / "cc"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "fake-cc 0.1"; exit 0; }\n'
                    'echo "fake-cc: internal compiler error" >&2\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(build, "build_candidates", lambda: [tmp_path / "kernels"])
    assert_falls_back(monkeypatch, caplog, "internal compiler error")


def test_no_writable_build_folder_falls_back_to_pytorch(tmp_path, monkeypatch, caplog):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setattr(build, "build_candidates", lambda: [not_a_folder / "kernels"])
    assert_falls_back(monkeypatch, caplog, "no writable build folder")


def test_no_ninja_falls_back_to_pytorch(as_a_new_process, monkeypatch, caplog):
    monkeypatch.setattr(build.cpp_extension, "is_ninja_available", lambda: False)
    assert_falls_back(monkeypatch, caplog, "Ninja is required")


def test_a_library_that_does_not_load_falls_back_to_pytorch(as_a_new_process, monkeypatch, caplog):
    def corrupt_build(name: str, build_directory: str, **_) -> None:
        """As if the linker had left a corrupt file: torch's loader meets it."""
        library = Path(build_directory) / f"{name}.so"
        library.write_bytes(b"\x7fELF but not really")
        torch.ops.load_library(str(library))

    monkeypatch.setattr(build.cpp_extension, "load", corrupt_build)
    assert_falls_back(monkeypatch, caplog, "does not load")


def test_a_second_build_in_one_process_is_refused_not_loaded(monkeypatch, caplog):
    """A process cannot hold two libraries defining the llmpipe ops: the one loaded stays in use."""
    assert build.library() is not None
    build.reset()
    monkeypatch.setattr(build, "FLAGS", (*build.FLAGS, "-DANOTHER_BUILD"))
    monkeypatch.setattr(build, "_compile", lambda compiler, source, folder: folder / f"{source.stem}.o")
    assert_falls_back(monkeypatch, caplog, "is loaded in this process already")


def test_the_build_is_named_by_every_source_the_flags_the_compilers_and_torch(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc, ignore=shutil.ignore_patterns("_build"))
    monkeypatch.setattr(build, "CSRC", csrc)
    monkeypatch.setattr(build, "build_candidates", lambda: [tmp_path / "kernels"])
    paths = [build.library_path(COMPILER)]
    for edited in ("simd.h", "ops.cpp", "paged_attention.c"):
        with (csrc / edited).open("a") as source:
            source.write("\n")
        paths.append(build.library_path(COMPILER))
    monkeypatch.setattr(build, "FLAGS", (*build.FLAGS, "-DEXTRA"))
    paths.append(build.library_path(COMPILER))
    monkeypatch.setattr(torch, "__version__", "99.0")
    paths.append(build.library_path(COMPILER))
    monkeypatch.setattr(build, "compiler_version", lambda compiler: compiler.encode() + b" 99")
    paths.append(build.library_path(COMPILER))
    assert len(set(paths)) == len(paths)
    assert all(p.parent.name == p.stem for p in paths)


def test_ninja_is_looked_for_first_beside_the_interpreter_while_building_only(monkeypatch):
    """Where `pip install ninja` puts it, which a venv's python run by its path lacks on PATH."""
    monkeypatch.setenv("PATH", "/nowhere")
    with build._interpreter_bin_on_path():
        assert os.environ["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), "/nowhere"]
    assert os.environ["PATH"] == "/nowhere"


def test_the_fallback_build_folder_is_per_user_and_refused_if_another_user_owns_it(tmp_path):
    assert str(os.getuid()) in build.build_candidates()[-1].name
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    if os.getuid() != 0:
        pytest.skip("only root can make a folder another user owns")
    os.chown(theirs, 12345, 12345)
    assert not build._usable_dir(theirs)
    assert build._usable_dir(tmp_path / "mine")
