"""INT8 / INT4 KV cache: what is stored, what attention reads back, and what the engine reports."""

from __future__ import annotations

import pytest
import torch

from llmpipe import LLM, SamplingParams
from llmpipe.kv_cache.paged import kv_bytes_per_token
from llmpipe.layers.attention import AttentionMetadata, PrefillChunk, paged_attention, read_blocks, write_kv
from llmpipe.quant.kv import KV_INT4_GROUP, QuantizedKV, hadamard
from tests.models.test_llama_parity import PROMPT

SHAPE = (2, 4, 16, 3, 64)  # K/V, blocks, block size, kv heads, head dim


def stored(kind: str) -> tuple[QuantizedKV, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    kv = QuantizedKV(*QuantizedKV.storage(kind, SHAPE, "cpu"), head_dim=SHAPE[-1])
    k, v = torch.randn(10, 3, 64) * 3, torch.randn(10, 3, 64)
    slots = torch.tensor([0, 1, 2, 17, 18, 33, 34, 35, 60, 63])
    write_kv(kv, k, v, slots)
    return kv, k, v, slots


def test_int8_kv_round_trip_is_within_half_a_step_per_token_and_head():
    kv, k, v, slots = stored("int8")
    back = read_blocks(kv, torch.arange(4), torch.float32).flatten(1, 2)[:, slots]
    for original, got in ((k, back[0]), (v, back[1])):
        step = original.abs().amax(dim=-1, keepdim=True) / 127
        assert ((got - original).abs() <= step / 2 + 1e-3 * step).all()


def test_int4_kv_round_trip_is_within_half_a_step_per_group():
    kv, k, v, slots = stored("int4")
    back = read_blocks(kv, torch.arange(4), torch.float32).flatten(1, 2)[:, slots]
    rotation = hadamard(SHAPE[-1])
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(SHAPE[-1]), atol=1e-6, rtol=0)  # orthonormal
    assert torch.equal(kv.rotation, rotation)
    for original, got in ((k @ rotation, back[0]), (v @ rotation, back[1])):  # stored rotated
        groups = original.unflatten(-1, (-1, KV_INT4_GROUP))
        step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
        err = (got.unflatten(-1, (-1, KV_INT4_GROUP)) - groups).abs()
        assert (err <= step / 2 + 2e-3 * step + 2e-3).all()  # scales and minimums are float16


def int4_attention_error(q, k, v, rotate: bool) -> float:
    """Relative error of attention over an int4 cache (one 40-token prefill) against a float cache."""
    meta = AttentionMetadata(torch.arange(len(q)), 0, None, None, [PrefillChunk(0, len(q), len(q), torch.arange(3))])
    shape = (2, 3, 16, k.shape[1], k.shape[2])
    expected = paged_attention(q, k, v, torch.zeros(shape), meta, scale=0.125)
    kv = QuantizedKV(*QuantizedKV.storage("int4", shape, "cpu"), head_dim=shape[-1])
    if not rotate:
        kv.rotation = None
    got = paged_attention(q, k, v, kv, meta, scale=0.125)
    return ((got - expected).norm() / expected.norm()).item()


def test_int4_kv_attention_undoes_the_rotation_and_tames_outlier_channels():
    """Keys with a few dominant channels (as RoPE'd keys have): attention over the rotated int4 cache
    stays near the float cache's, and nearer than without the rotation."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, heads, 64, generator=gen) for heads in (6, 3, 3))
    k[..., :3] *= 20
    rotated, plain = int4_attention_error(q, k, v, rotate=True), int4_attention_error(q, k, v, rotate=False)
    assert rotated < 0.2 and rotated < 0.7 * plain, (rotated, plain)  # un-rotated, the error would be ~1.4


def test_reads_of_other_blocks_are_untouched():
    kv, *_ = stored("int8")
    assert not read_blocks(kv, torch.tensor([3]), torch.float32)[:, 0, :12].any()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_bytes_per_token_count_codes_and_scales(tiny_checkpoint, kind):
    llm = LLM(str(tiny_checkpoint("llama_gqa")), kv_cache_dtype=kind, progress=False, kv_cache_memory="1MiB")
    cfg = llm.engine.config.model_config
    vectors = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
    head_dim = cfg.head_dim
    groups = -(-head_dim // KV_INT4_GROUP)  # float16 scale + minimum each
    expected = vectors * (head_dim + 2 if kind == "int8" else head_dim // 2 + 4 * groups)
    assert llm.engine.stats().kv_bytes_per_token == expected == kv_bytes_per_token(cfg, torch.float32, kind)
    float_bytes = kv_bytes_per_token(cfg, torch.bfloat16)
    blocks = llm.engine.stats().num_blocks
    float_blocks = LLM(str(tiny_checkpoint("llama_gqa")), dtype="bfloat16", progress=False,
                       kv_cache_memory="1MiB").engine.stats().num_blocks
    assert blocks / float_blocks == pytest.approx(float_bytes / expected, rel=0.02)


@pytest.mark.parametrize("kind, tolerance", [("int8", 0.05), ("int4", 0.5)])
def test_generation_with_quantized_kv_stays_close_to_float(tiny_checkpoint, kind, tolerance):
    """Decode logits with the quantized cache stay near the float cache's (same tokens fed to both)."""
    path = str(tiny_checkpoint("llama_gqa"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    base = LLM(path, progress=False).generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    quant_llm = LLM(path, kv_cache_dtype=kind, progress=False)
    full = quant_llm.engine.score(PROMPT + base.token_ids).log_softmax(-1)  # prefill reads the quantized cache
    reference = LLM(path, progress=False).engine.score(PROMPT + base.token_ids).log_softmax(-1)
    assert (full - reference).abs().max().item() < tolerance
    if kind == "int8":  # int4 KV on a tiny random model moves near-ties; its quality is measured by perplexity
        assert full.argmax(-1).tolist() == reference.argmax(-1).tolist()
