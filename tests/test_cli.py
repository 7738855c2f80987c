"""The command line: streamed output, and one readable line (no traceback) for every user error."""

import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmpipe.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_streams_text_and_timing(tiny_checkpoint):
    result = run_cli("generate", "the quick brown fox", "--model", str(tiny_checkpoint("llama_gqa")),
                     "--max-tokens", "8", "--no-chat", "--temperature", "0.8", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "TTFT" in result.stderr and "tokens/s" in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/no/such/model.gguf"], "/no/such/model.gguf"),
        (["--model", "no-such-alias"], "no-such-alias"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--kv-cache-memory", "lots"], "kv_cache_memory"),
    ],
)
def test_user_errors_are_one_line_without_traceback(tiny_checkpoint, args, message):
    if "--model" not in args:
        args = args + ["--model", str(tiny_checkpoint("llama_gqa"))]
    result = run_cli("generate", "hello", "--no-chat", *args)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("llmpipe: error:")]
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in result.stderr


def test_corrupt_gguf_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    result = run_cli("generate", "hello", "--model", str(bad))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "broken.gguf" in result.stderr


def test_chat_repl_answers_each_turn(tiny_checkpoint):
    result = subprocess.run(
        [sys.executable, "-m", "llmpipe.cli", "chat", "--model", str(tiny_checkpoint("llama_gqa")),
         "--max-tokens", "4", "--temperature", "0.8", "--seed", "3"],
        input="the quick brown fox\nhow does inference work?\n/exit\n",
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("TTFT") == 2  # one streamed reply per turn


def test_engine_flags_reach_the_engine(tiny_checkpoint):
    result = run_cli("generate", "the quick brown fox", "--model", str(tiny_checkpoint("llama_gqa")), "--no-chat",
                     "--max-tokens", "4", "--max-num-blocks", "8", "--block-size", "16", "--max-num-seqs", "2",
                     "--max-num-batched-tokens", "32", "--no-enable-prefix-caching", "--kv-cache-memory", "64MiB")
    assert result.returncode == 0, result.stderr
    # A one-block pool of 4 tokens caps the context, so a 9-word prompt is refused: the flags took effect.
    tiny_pool = run_cli("generate", "the quick brown fox jumps over the lazy dog", "--model",
                        str(tiny_checkpoint("llama_gqa")), "--no-chat", "--max-num-blocks", "1", "--block-size", "4")
    assert tiny_pool.returncode == 1 and "context limit" in tiny_pool.stderr


def test_the_docs_table_every_engine_option_as_engine_config_defines_it():
    """docs/getting-started.md's options table is engine_args.options_table(), row for row."""
    from llmpipe.engine_args import options_table

    doc = (Path(__file__).parents[1] / "docs" / "getting-started.md").read_text()
    for row in options_table():
        assert row in doc, row


def test_engine_flags_are_generated_from_engine_config_with_its_defaults():
    """Every command's engine flags parse to EngineConfig's own defaults, and `none` to None."""
    import argparse
    import dataclasses

    from llmpipe.config import EngineConfig
    from llmpipe.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = EngineConfig()
    kwargs = engine_kwargs(parser.parse_args([]))
    cli = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)} - {"model"}
    assert set(kwargs) == cli and {"kv_cache", "seed", "model_config"}.isdisjoint(kwargs)
    assert kwargs == {name: getattr(defaults, name) for name in cli}
    parsed = engine_kwargs(parser.parse_args(["--quantization", "none", "--max-decode-stall", "2.5", "--max-model-len",
                                              "64", "--no-enable-prefix-caching", "--float-batch-weights"]))
    assert parsed == {**kwargs, "quantization": None, "max_decode_stall": 2.5, "max_model_len": 64,
                           "enable_prefix_caching": False, "float_batch_weights": True}
    EngineConfig(**parsed)  # valid as parsed
