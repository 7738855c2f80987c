"""The llama.cpp peer: clear errors when it is not built or cannot be, and llama-bench's JSON read
back (a fake llama-bench on disk, so no build is needed)."""

from __future__ import annotations

import json
import stat

import pytest

from llmpipe.bench import peers


def test_a_missing_build_tool_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(peers.shutil, "which", lambda tool: None if tool == "cmake" else f"/usr/bin/{tool}")
    with pytest.raises(peers.PeerUnavailableError, match="needs cmake on PATH"):
        peers.build(tmp_path / "cache")


def test_an_unbuilt_peer_says_how_to_build_it(tmp_path):
    with pytest.raises(peers.PeerUnavailableError, match="make bench-peers"):
        peers.llama_bench(tmp_path / "m.gguf", 2, cache=tmp_path)


def test_llama_bench_results_are_read_and_a_repack_crash_is_retried_without_it(tmp_path):
    fake = tmp_path / "bin" / "llama-bench"
    fake.parent.mkdir()
    row = lambda p, n, ts: json.dumps([{"n_prompt": p, "n_gen": n, "avg_ts": ts}])  # noqa: E731
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"-p 512"*) case "$*" in *"--repack 0"*) ;; *) exit 139;; esac;'
        f" echo '{row(512, 0, 250.5)}';; *) echo '{row(0, 128, 140.25)}';; esac\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    rates = peers.llama_bench(tmp_path / "m.gguf", 2, 512, 128, cache=tmp_path)
    assert rates == {"pp512": 250.5, "pp512_flags": "--repack 0", "tg128": 140.25, "tg128_flags": ""}


def test_decode_at_a_depth_passes_it_to_llama_bench(tmp_path):
    fake = tmp_path / "bin" / "llama-bench"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    """case "$*" in *"-p 0 -n 64 -d 2048"*) echo '[{"avg_ts": 120.5}]';; *) exit 1;; esac\n""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert peers.llama_bench_decode(tmp_path / "m.gguf", 2, 2048, 64, cache=tmp_path) == 120.5
