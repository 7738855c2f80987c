"""DeepSeek V4 attention on the paged compressed cache against transformers' DeepseekV4Attention.

One layer of each kind (window only, HCA, CSA) with random weights; window 8, ratios 4 (CSA) and
16 (HCA), block size 4, index_topk 4 (so the indexer really chooses; 16 index heads make an exact
tie between ReLU scores, where either choice is right, all but impossible). The reference runs the whole
sequence at once without a cache; llmpipe runs it through the model runner's metadata and the
block manager, in one prefill or in chunks and single decode steps, and must give the same rows.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402

from llmpipe.config import EngineConfig  # noqa: E402
from llmpipe.engine.block_manager import BlockManager, BlockTable, PrefixHit  # noqa: E402
from llmpipe.engine.kv_pool import plan_kv_pool  # noqa: E402
from llmpipe.engine.model_runner import ModelRunner  # noqa: E402
from llmpipe.models.deepseek_v4 import attention as compressed_attention  # noqa: E402
from llmpipe.models.deepseek_v4.attention import DeepseekV4Attention  # noqa: E402
from llmpipe.layers.rotary import InterleavedRotaryEmbedding  # noqa: E402
from llmpipe.loader.hf_config import hf_model_config  # noqa: E402

KINDS = ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"]
BLOCK, VOCAB, HIDDEN = 4, 64, 64


def hf_config(kind: str) -> "transformers.DeepseekV4Config":
    cfg = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25, n_routed_experts=4, num_experts_per_tok=2,
        layer_types=[kind], compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=["moe"], sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16,
        index_topk=4, hc_mult=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    )
    cfg._attn_implementation = "eager"
    return cfg


class AttentionOnly(nn.Module):
    """Embedding rows → one V4 attention layer: a model the runner can drive."""

    def __init__(self, cfg, table: torch.Tensor):
        super().__init__()
        v4, n = cfg.extra, cfg.max_position_embeddings
        self.config, self.table = cfg, table
        self.attn = DeepseekV4Attention(cfg, 0)
        self.ropes = (InterleavedRotaryEmbedding(v4.rope_head_dim, n, cfg.rope_theta, None),
                      InterleavedRotaryEmbedding(v4.rope_head_dim, n, v4.compress_rope_theta, v4.compress_rope_scaling))

    def forward(self, ids, positions, caches, metas):
        return self.attn(self.table[ids], positions, self.ropes, caches[0], metas[0])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # the attention output is what is compared


def reference(cfg, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[1])[None]
    rotary = hf.DeepseekV4RotaryEmbedding(cfg)
    ropes = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    i = torch.arange(x.shape[1])
    allowed = (i[None] <= i[:, None]) & (i[None] > i[:, None] - cfg.sliding_window)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
    return layer(x, position_embeddings=ropes, position_ids=positions, attention_mask=mask, cache=None)[0][0]


@pytest.fixture(params=KINDS)
def pair(request, tmp_path):
    torch.manual_seed(KINDS.index(request.param))
    cfg = hf_config(request.param)
    ref = hf.DeepseekV4Attention(cfg, 0).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():  # biases, sinks and gates big enough to matter
            p.copy_(torch.randn_like(p) * (0.5 if "bias" in name or "sinks" in name else 0.2))
    cfg.save_pretrained(tmp_path)
    ours = AttentionOnly(hf_model_config(tmp_path), torch.randn(VOCAB, HIDDEN))
    ours.attn.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ref, ours


def runner_for(model: AttentionOnly):
    config = EngineConfig(max_num_blocks=300, block_size=BLOCK)
    config.model_config = model.config
    layout, _, num_blocks = plan_kv_pool(config, model)
    blocks = BlockManager(num_blocks, BLOCK, [g.spec for g in layout.groups])
    return ModelRunner(model, config, num_blocks, layout), blocks, layout


def new_sequence(blocks: BlockManager, ids: torch.Tensor):
    seq = SimpleNamespace(block_tables=[], block_hashes=[], all_token_ids=ids.tolist(), num_computed_tokens=0,
                          num_cached_tokens=0, num_hashed_blocks=0)
    blocks.allocate(seq, PrefixHit(0, [BlockTable() for _ in blocks.specs]), 0)
    return seq


@pytest.mark.parametrize("query_block", [256, 24])  # one run of queries, or runs of 24 cut off-boundary
@torch.inference_mode()
def test_prefill_matches_transformers(pair, query_block, monkeypatch):
    monkeypatch.setattr(compressed_attention, "QUERY_BLOCK", query_block)
    cfg, ref, ours = pair
    ids = torch.randint(0, VOCAB, (200,))  # 50 CSA entries (the indexer keeps 4), 12 HCA entries
    want = reference(cfg, ref, ours.table[ids][None])
    runner, blocks, _ = runner_for(ours)
    seq = new_sequence(blocks, ids)
    blocks.reserve(seq, len(ids))
    torch.testing.assert_close(runner.score(ids.tolist(), seq.block_tables), want, atol=2e-5, rtol=1e-4)


@torch.inference_mode()
def test_chunks_and_decode_steps_across_compression_boundaries_match_a_full_recompute(pair):
    cfg, ref, ours = pair
    ids = torch.randint(0, VOCAB, (150,))
    want = reference(cfg, ref, ours.table[ids][None])
    runner, blocks, layout = runner_for(ours)
    seq = new_sequence(blocks, ids)
    start = 0
    for n in [37, 23, 1, 1, 17, 1, 5] + [1] * 65:  # chunks and decodes crossing every 4- and 16-token boundary
        end = start + n
        blocks.reserve(seq, n)
        if n == 1:
            metas = runner._layer_metadata([seq.block_tables], [end], [])
        else:
            metas = runner._layer_metadata([], [], [(seq.block_tables, start, end, 0)])
        got = ours(ids[start:end], torch.arange(start, end), runner.kv_cache.layers, metas)
        torch.testing.assert_close(got, want[start:end], atol=2e-5, rtol=1e-4)
        seq.num_computed_tokens = start = end
        blocks.free_unreachable(seq)
    # The window store keeps only what queries and open compression windows still read.
    for group, table in zip(layout.groups, seq.block_tables):
        assert len(table.ids) == group.spec.blocks_held(len(ids), BLOCK)
