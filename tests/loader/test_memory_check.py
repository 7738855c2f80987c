"""A model that cannot fit is refused before it loads, in one line that says how much it needs and
how much there is; /proc/meminfo is read as the kernel writes it."""

from __future__ import annotations

import pytest

from llmpipe import LLM
from llmpipe.errors import ModelLoadError
from llmpipe.loader.memory_check import GiB, available_bytes, check_fits

MEMINFO = """MemTotal:       24576000 kB
MemFree:         1000000 kB
MemAvailable:    3145728 kB
Buffers:           10000 kB
SwapTotal:       2097152 kB
SwapFree:        1048576 kB
"""


def test_available_is_memavailable_plus_swapfree(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    assert available_bytes(meminfo) == (3145728 + 1048576) * 1024  # 4 GiB


def test_no_meminfo_checks_nothing(tmp_path):
    assert available_bytes(tmp_path / "absent") is None
    check_fits("m", 10**15, 0, None)


def test_a_model_past_the_memory_is_one_line_naming_both_figures():
    with pytest.raises(ModelLoadError) as err:
        check_fits("llama-8b.gguf", int(4.6 * GiB), GiB, 3 * GiB)
    message = str(err.value)
    assert "\n" not in message
    assert "needs at least 5.6 GiB (weights 4.6 GiB + KV pool 1.0 GiB)" in message and "3.0 GiB available" in message
    check_fits("llama-8b.gguf", int(4.6 * GiB), GiB, 6 * GiB)  # fits: no error


def test_the_engine_refuses_before_loading(tiny_checkpoint, monkeypatch):
    path = str(tiny_checkpoint("llama_gqa"))
    loaded = []
    monkeypatch.setattr("llmpipe.engine.executor.available_bytes", lambda: 2**20)  # 1 MiB left
    monkeypatch.setattr("llmpipe.engine.executor.load_model", lambda *a, **k: loaded.append(a))
    with pytest.raises(ModelLoadError, match="KV pool 0.1 GiB"):
        LLM(path, progress=False, kv_cache_memory="128MiB")
    assert not loaded
