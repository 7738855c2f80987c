"""`llmpipe memory` for DeepSeek V4 and MLA configs: the published figures by hand, the cache by transformers."""

import json

import pytest
import torch

from llmpipe.cli import main
from llmpipe.diagnose.compressed_kv import layer_schedule, plan_compressed_kv, read_config

MILLION = 1_048_576
GIB = 2**30


def plan(name: str, context: int, dtype: str = "bfloat16"):
    return plan_compressed_kv(read_config(name)[0], name, dtype=dtype, context=context)


def test_deepseek_v4_pro_at_a_million_tokens_is_9_62_gib():
    """30 CSA layers: a 512-wide entry and a 128-wide indexer key per 4 tokens; 31 HCA layers: a 512-wide entry per
    128 tokens; bf16. The published figure leaves out the 128-token window of every layer and the compressor's
    pending state, which do not move it off 9.62."""
    p = plan("deepseek-v4-pro", MILLION)
    csa, hca = {k.kind: k for k in p.kinds}["CSA (ratio 4)"], {k.kind: k for k in p.kinds}["HCA (ratio 128)"]
    assert (csa.layers, hca.layers) == (30, 31) and len(p.kinds) == 2  # no window-only layer in V4-Pro
    assert csa.entries == 30 * (MILLION // 4) * 512 * 2 and csa.indexer == 30 * (MILLION // 4) * 128 * 2
    assert hca.entries == 31 * (MILLION // 128) * 512 * 2 and hca.indexer == 0
    published = csa.entries + csa.indexer + hca.entries
    assert published == 10_326_376_448 and round(published / GIB, 2) == 9.62
    window = 61 * 128 * 512 * 2
    overlap = 30 * 2 * 4 * (512 + 128) * 2  # CSA's last closed window (kv and gate); 2**20 leaves no token waiting
    assert p.kv_bytes_per_sequence == published + window + overlap == 10_334_679_040
    assert round(p.kv_bytes_per_sequence / GIB, 2) == 9.62
    assert p.kv_bytes_per_token == 30 * 640 * 2 / 4 + 31 * 512 * 2 / 128 == 9_848


def test_v32_style_mla_at_a_million_tokens_is_83_9_gib():
    p = plan("deepseek-v3.2", MILLION)
    assert p.kv_bytes_per_sequence == 61 * MILLION * (512 + 64 + 128) * 2 == 90_060_095_488
    assert round(p.kv_bytes_per_sequence / GIB, 1) == 83.9
    assert p.kv_bytes_per_token == 61 * 704 * 2 == 85_888
    v4 = plan("deepseek-v4-pro", MILLION).kv_bytes_per_sequence
    assert round(v4 / p.kv_bytes_per_sequence, 3) == 0.115  # the textbook "about 10%"


@pytest.mark.parametrize("name,context,published,with_window", [
    ("deepseek-v4-flash", MILLION, 6.72, 6.72),  # 2 window-only layers, 21 CSA, 20 HCA
    ("deepseek-v4-pro", 131_072, 1.20, 1.21),  # where the window shows: the published table leaves it out
])
def test_the_same_accounting_gives_the_other_published_figures(name, context, published, with_window):
    p = plan(name, context)
    assert round(sum(k.entries + k.indexer for k in p.kinds) / GIB, 2) == published
    assert round(sum(k.entries + k.indexer + k.window for k in p.kinds) / GIB, 2) == with_window


def test_layer_schedule_matches_transformers():
    from transformers import DeepseekV4Config

    for name in ("deepseek-v4-pro", "deepseek-v4-flash"):
        cfg = read_config(name)[0]
        reference = DeepseekV4Config(num_hidden_layers=cfg["num_hidden_layers"], compress_ratios=cfg["compress_ratios"])
        assert layer_schedule(cfg) == (reference.layer_types, reference.compress_rates)


@pytest.mark.parametrize("prefill,decode", [(42, 0), (37, 5)])
def test_plan_counts_what_the_reference_cache_holds(tmp_path, capsys, prefill, decode):
    """A tiny transformers DeepSeek V4 (window 8, CSA ratio 4, HCA ratio 16) after 42 tokens: the planner, reading
    the config.json transformers saves, counts each layer's tensors (batch 1, float32). The reference keeps
    `sliding_window - 1` window tokens between steps; attention reads those and the new token."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache

    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
        head_dim=32, q_lora_rank=16, n_routed_experts=2, num_experts_per_tok=1, hc_mult=2, hc_sinkhorn_iters=2,
        o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=["moe"] * 3)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).eval()
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, prefill)), cache=cache)
        for _ in range(decode):
            model(torch.randint(0, 64, (1, 1)), cache=cache)
    cfg.save_pretrained(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["memory", "--model", str(tmp_path), "--context", "42", "--json", str(out)]) == 0
    kinds = {k["kind"]: k for k in json.loads(out.read_text())["kinds"]}

    def numel(states: dict) -> int:
        return sum(t.numel() for t in states.values())

    window, csa, hca = cache.layers
    assert kinds["window only"]["window"] == (window.keys.shape[-2] + 1) * 32 * 4
    for kind, layer in (("CSA (ratio 4)", csa), ("HCA (ratio 16)", hca)):
        assert kinds[kind]["window"] == (layer.keys.shape[-2] + 1) * 32 * 4
        assert kinds[kind]["entries"] == layer.compressed_kv["compressor"].numel() * 4
        assert kinds[kind]["indexer"] == (layer.compressed_kv["indexer"].numel() * 4 if layer is csa else 0)
        pending = numel(layer.buffer_kv) + numel(layer.buffer_gate)
        if layer is csa:
            pending += numel(layer.overlap_kv) + numel(layer.overlap_gate)
        assert kinds[kind]["pending"] == pending * 4
    assert csa.compressed_kv["compressor"].shape[1] == 10 and hca.compressed_kv["compressor"].shape[1] == 2


def test_memory_command_prints_kinds_and_totals(capsys):
    assert main(["memory", "--arch", "deepseek-v4-pro", "--context", str(MILLION), "--dtype", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "CSA (ratio 4)" in text and "HCA (ratio 128)" in text and "9,848 B" in text
    assert "10,334,679,040 B" in text and "9.617 GiB" in text
    assert main(["memory", "--arch", "deepseek-v4-pro", "--memory", "80GiB"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memory" in err[0]
