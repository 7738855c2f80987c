"""DeepSeek V4's paged cache layout: what each store keeps, how stores share pages, and that the engine's
bytes per sequence follow from the blocks a sequence really holds."""

import json

import pytest
import torch

from llmpipe import LLM, SamplingParams
from llmpipe.diagnose.compressed_kv import plan_compressed_kv, read_config
from llmpipe.models.deepseek_v4.cache import CompressedKVCache, compressed_kv_layout, store_specs
from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.hf_config import hf_model_config


@pytest.fixture(scope="module")
def v4_pro(tmp_path_factory):
    """DeepSeek-V4-Pro's config (the planner's shipped numbers + the model fields the loader needs)."""
    cfg, _ = read_config("deepseek-v4-pro")
    path = tmp_path_factory.mktemp("v4_pro")
    (path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 129280, "hidden_size": 7168, "num_attention_heads": 128}))
    return cfg, hf_model_config(path)


def test_store_specs_keep_the_window_and_the_open_compression_windows(v4_pro):
    _, model = v4_pro
    kinds = model.extra.layer_types
    csa, hca = kinds.index("compressed_sparse_attention"), kinds.index("heavily_compressed_attention")
    window, entry = store_specs(model, csa)
    # K=V (512) + compressor value and gate, two halves each (4 × 512) + indexer value and gate (4 × 128).
    assert (window.window, window.width) == (128, 512 + 2048 + 512)
    assert (entry.ratio, entry.width) == (4, 512 + 128)  # the entry and its indexer key
    window, entry = store_specs(model, hca)
    assert (window.window, window.width) == (128, 512 + 1024) and (entry.ratio, entry.width) == (128, 512)
    assert "sliding_attention" not in kinds  # Pro's one window-only entry in compress_ratios is its MTP layer's


def test_v4_pro_pages_grow_as_the_published_cache_does(v4_pro):
    cfg, model = v4_pro
    layout = compressed_kv_layout([store_specs(model, layer) for layer in range(model.num_hidden_layers)])
    assert layout.row_elements == 5 * 640  # five CSA entry stores side by side fill a page row exactly
    cache = CompressedKVCache(layout, num_blocks=1, block_size=16, dtype=torch.bfloat16, device="cpu")
    planned = plan_compressed_kv(cfg, "deepseek-v4-pro", dtype="bfloat16", context=1 << 20).kv_bytes_per_token
    assert planned == 9848  # 30 × (512 + 128) × 2 B / 4 + 31 × 512 × 2 B / 128
    assert planned <= cache.bytes_per_token <= 1.01 * planned  # page padding costs < 1%
    for group in layout.groups:
        assert len(group.layers) * group.spec.block_rows * group.spec.width <= layout.row_elements
        assert 128 % group.spec.span == 0  # a prefix hit (a multiple of 128 × 16 tokens) covers whole blocks


def test_a_sequence_holds_the_blocks_its_layout_implies(tiny_deepseek_v4):
    llm = LLM(str(tiny_deepseek_v4()), max_num_batched_tokens=64, progress=False)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": list(range(5, 305))}, SamplingParams(max_tokens=40, ignore_eos=True))
    held = {}
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.core.scheduler.running[0] if engine.core.scheduler.running else None
        if seq is not None and not seq.in_prefill:
            held[seq.num_computed_tokens] = engine.stats().kv_bytes_per_seq["r"]
    assert held and all(held[n] == engine.kv_bytes_per_sequence(n) for n in held)
    # Past the windows a sequence grows only by entry pages: 40 more tokens cost a few entry blocks at most.
    first, last = min(held), max(held)
    pages = (held[last] - held[first]) // engine.core.block_bytes
    assert 0 <= pages <= sum(-(-(last - first) // g.spec.tokens_per_block(16)) + 1 for g in engine.kv_layout.groups
                             if g.spec.window is None)


@pytest.mark.parametrize("option, message", [
    ({"kv_cache_dtype": "int8"}, "stored in the model dtype"),
    ({"tensor_parallel_size": 2}, "tensor parallelism"),
    ({"disable_sliding_window": True}, "cannot be disabled"),
])
def test_options_the_compressed_cache_does_not_take_are_refused_in_one_line(tiny_deepseek_v4, option, message):
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(str(tiny_deepseek_v4()), progress=False, **option)
