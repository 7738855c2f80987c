"""`llmpipe bench compressed` on tiny contexts: the report's structure, and the KV bytes each engine says the
sequence holds, checked against the blocks its layout implies (V4) and 2 × layers × KV heads × head_dim
of whole 16-token blocks (dense)."""

import json
import sys

import pytest

from llmpipe.cli import main
from llmpipe.models.deepseek_v4.cache import compressed_kv_layout, store_specs
from llmpipe.loader.checkpoint import load_checkpoint

# 509 + 2 computed tokens: the window's first block moves on with the last token (a window store holds the
# blocks the next query reads, not those the last one read).
CONTEXTS, DECODE, BLOCK = (256, 509), 3, 16
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_compressed")
    argv = ["bench", "compressed", "--contexts", *map(str, CONTEXTS), "--decode-tokens", str(DECODE),
            "--hidden-size", "64", "--num-layers", "6", "--checkpoint-dir", str(out / "ckpt"),
            "--output", str(out / "c.json"), "--plot", str(out / "c.png")]
    assert main(argv) == 0
    return out, json.loads((out / "c.json").read_text())


def test_report_has_both_models_at_every_context(run):
    out, report = run
    assert list(report["contexts"]) == [str(c) for c in CONTEXTS]
    for context, row in report["contexts"].items():
        for model in ("v4", "dense"):
            # The last step finishes the request; bytes are read after the one before: the prompt and
            # every decoded token but the last are computed then.
            assert row[model]["tokens"] == int(context) + DECODE - 1
            assert row[model]["decode_itl_ms"] > 0 and row[model]["prefill_s"] > 0
        assert row["kv_ratio"] == pytest.approx(row["v4"]["kv_bytes_per_seq"] / row["dense"]["kv_bytes_per_seq"])
        assert row["itl_ratio"] == pytest.approx(row["v4"]["decode_itl_ms"] / row["dense"]["decode_itl_ms"])
    v4, dense = report["models"]["v4"]["config"], report["models"]["dense"]["config"]
    assert v4["layer_types"] == ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                                 "heavily_compressed_attention", "compressed_sparse_attention",
                                 "heavily_compressed_attention"]
    assert (dense["hidden_size"], dense["num_hidden_layers"]) == (v4["hidden_size"], v4["num_hidden_layers"])
    params = report["models"]["v4"]["params"], report["models"]["dense"]["params"]
    assert abs(params[0] - params[1]) < 0.02 * params[0]  # the MLP width is solved to match
    assert (out / "c.png").read_bytes().startswith(PNG_MAGIC)


def test_dense_kv_bytes_are_whole_blocks_of_k_and_v(run):
    _, report = run
    for row in report["contexts"].values():
        tokens = row["dense"]["tokens"]
        per_token = 2 * 6 * 2 * 64 * 4  # K and V × layers × KV heads × head_dim × float32
        assert row["dense"]["analytic_kv_bytes"] == tokens * per_token
        assert row["dense"]["kv_bytes_per_seq"] == -(-tokens // BLOCK) * BLOCK * per_token


def test_v4_kv_bytes_are_the_blocks_its_layout_holds(run):
    out, report = run
    config = load_checkpoint(out / "ckpt" / "v4").config
    layout = compressed_kv_layout([store_specs(config, layer) for layer in range(config.num_hidden_layers)])
    block_bytes = BLOCK * layout.row_elements * 4
    for row in report["contexts"].values():
        tokens = row["v4"]["tokens"]  # positions 0 … tokens - 1 computed; the next query is at `tokens`
        blocks = 0
        for group in layout.groups:
            spec = group.spec
            if spec.window is None:  # entry store: every block from the first entry's to the last token's;
                # a block holds BLOCK × block_rows entries of `ratio` tokens each
                blocks += -(-tokens // (BLOCK * spec.block_rows * spec.ratio))
            else:  # window store: the blocks of positions tokens - window + 1 … tokens - 1
                blocks += -(-tokens // BLOCK) - max(0, tokens - spec.window + 1) // BLOCK
        assert row["v4"]["kv_bytes_per_seq"] == blocks * block_bytes
        assert 0 < row["v4"]["planned_kv_bytes"] < row["dense"]["analytic_kv_bytes"]


def test_without_transformers_it_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    assert main(["bench", "compressed", "--contexts", "64", "--checkpoint-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmpipe: error: bench compressed builds its checkpoints with transformers")
    assert "\n" not in err
