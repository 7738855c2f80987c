"""gpt-oss against transformers on tiny random-weight checkpoints (float32): 8 biased experts, 3 a token, the
clamped SwiGLU cutting in, sinks, windows of 8 on alternate layers, YaRN. Two forms of the same model:
transformers' own save (float 3-D experts) and OpenAI's release layout (the experts' weights as MXFP4 blocks
and scales, loaded as ggml's MXFP4 and read by the GGML kernels). Prefill, decode, chunked, batched, with
prefix-cache hits and preemption. (Its GGUF: tests/loader/test_gguf_gpt_oss.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmpipe import LLM
from llmpipe.errors import UnsupportedModelError
from llmpipe.layers.attention import (AttentionMetadata, PrefillChunk, paged_attention, reference_paged_attention)
from llmpipe.loader import load_checkpoint
from llmpipe.quant.linear import GGMLLinear
from tests.models.parity_suite import *  # noqa: F403  (the shared parity tests)
from tests.models.parity_suite import assert_prefix_hits_and_preemption_keep_the_reference
from tests.utils import TINY_CONFIGS, build_checkpoint

PROJECTIONS = ("gate_up_proj", "down_proj")


def random_mxfp4(experts: int, rows: int, columns: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenAI's layout: blocks uint8 [experts, rows, columns / 32, 16] (two E2M1 codes a byte, element 2j low),
    scales uint8 [experts, rows, columns / 32] (E8M0: 2^(s − 127)); values of about the tests' weight spread."""
    blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(121, 124, (experts, rows, columns // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


def mxfp4_checkpoint(float_dir: Path, out_dir: Path) -> Path:
    """float_dir's model with every expert weight replaced by random MXFP4 values: `out_dir` holds them as
    OpenAI ships them (quant_method mxfp4), float_dir is rewritten with their dequantized values (transformers'
    own `convert_moe_packed_tensors`), so the two directories hold one model."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(5)
    float_tensors, packed_tensors = load_file(float_dir / "model.safetensors"), {}
    for name, tensor in load_file(float_dir / "model.safetensors").items():
        if not name.endswith(tuple(f"experts.{p}" for p in PROJECTIONS)):
            packed_tensors[name] = tensor
            continue
        experts, columns, rows = tensor.shape  # transformers' [experts, in, out]
        blocks, scales = random_mxfp4(experts, rows, columns, generator)
        packed_tensors |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        float_tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(float_tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(float_dir, out_dir, dirs_exist_ok=True)
    save_file(packed_tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                           "model.layers.*.mlp.router",
                                                                                           "model.embed_tokens", "lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name → (the directory llmpipe loads, the float directory transformers loads)."""
    class_name, extra = TINY_CONFIGS["gpt_oss"]
    float_dir = build_checkpoint(class_name, extra, tmp_path_factory.mktemp("gpt_oss_float"))
    mxfp4_float = build_checkpoint(class_name, extra, tmp_path_factory.mktemp("gpt_oss_mxfp4_float"))
    mxfp4_dir = mxfp4_checkpoint(mxfp4_float, tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    return {"float": (float_dir, float_dir), "mxfp4": (mxfp4_dir, mxfp4_float)}


@pytest.fixture(scope="module", params=["float", "mxfp4"])
def case(request, checkpoints):
    """MXFP4's LLM meets its activations in float (the exact path: logits within 1e-4); the suite's other LLMs
    take the default 16-bit activation blocks of the integer-dot kernels (greedy tokens compared)."""
    import transformers

    path, reference_dir = checkpoints[request.param]
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    return path, reference, LLM(str(path), progress=False, activation_quantization=None)


def test_prefix_cache_hits_and_preemption_give_the_reference_tokens(case):
    """The windowed layers' blocks come from the same pool: 13 blocks hold what 9 hold for Qwen3-MoE."""
    assert_prefix_hits_and_preemption_keep_the_reference(case, max_num_blocks=13)


def test_the_config_reads_experts_windows_and_the_clamp(checkpoints):
    config = load_checkpoint(str(checkpoints["float"][0])).config
    moe = config.extra
    assert (moe.num_experts, moe.num_experts_per_tok, moe.swiglu_limit) == (8, 3, 0.6)
    assert [config.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["truncate"] is False


def test_mxfp4_experts_load_as_ggml_blocks_of_the_files_size(checkpoints):
    """Each expert's gate / up / down: ggml's MXFP4 blocks (17 bytes a 32), nothing widened to float."""
    llm = LLM(str(checkpoints["mxfp4"][0]), progress=False)
    expert = llm.engine.model.model.layers[0].mlp.experts[5]
    assert isinstance(expert.gate_up_proj, GGMLLinear) and isinstance(expert.down_proj, GGMLLinear)
    blocks = [b for layer in (expert.gate_up_proj, expert.down_proj) for _, b in layer.segment_blocks()]
    assert sum(b.numel() for b in blocks) == (2 * 64 * 64 + 64 * 64) // 32 * 17


def test_tensor_parallel_is_refused_in_one_line(checkpoints):
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size"):
        LLM(str(checkpoints["float"][0]), progress=False, tensor_parallel_size=2)


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_in_prefill_and_decode_attention_match_the_definition(window):
    """Two sequences' prefill chunks (one on a cached prefix), then a decode row each, against the per-token
    definition: a float32 cache decodes in the C kernel, a bfloat16 one in PyTorch."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    sinks = torch.randn(heads)
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(2, 16, block, kv_heads, dim, dtype=dtype)
        tables = [[0, 1, 2, 3], [4, 5, 6]]
        tokens = 13 + 4  # sequence 0 whole; sequence 1: 4 new tokens on 5 cached
        q, k, v = (torch.randn(tokens, n, dim, dtype=dtype) for n in (heads, kv_heads, kv_heads))
        ctx = torch.randn(5, kv_heads, dim, dtype=dtype), torch.randn(5, kv_heads, dim, dtype=dtype)
        flat = cache.flatten(1, 2)
        slots1 = [tables[1][p // block] * block + p % block for p in range(9)]
        flat[0, slots1[:5]], flat[1, slots1[:5]] = ctx
        slots = [tables[0][p // block] * block + p % block for p in range(13)] + slots1[5:]
        chunks = [PrefillChunk(0, 13, 13, torch.tensor(tables[0])), PrefillChunk(13, 17, 9, torch.tensor(tables[1]))]
        meta = AttentionMetadata(torch.tensor(slots), 0, None, None, chunks)
        out = paged_attention(q, k, v, cache, meta, 0.3, window, sinks)
        positions = list(range(13)) + list(range(5, 9))
        token_tables = [tables[0]] * 13 + [tables[1]] * 4
        expected = reference_paged_attention(q, cache, token_tables, positions, 0.3, window, sinks)
        torch.testing.assert_close(out, expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
        decode_q = torch.randn(2, heads, dim, dtype=dtype)
        decode_k, decode_v = torch.randn(2, kv_heads, dim, dtype=dtype), torch.randn(2, kv_heads, dim, dtype=dtype)
        slots = [tables[0][13 // block] * block + 13 % block, tables[1][9 // block] * block + 9 % block]
        padded = torch.tensor([tables[0], tables[1] + [0]])
        meta = AttentionMetadata(torch.tensor(slots), 2, padded, torch.tensor([14, 10]), [], 14, False)
        out = paged_attention(decode_q, decode_k, decode_v, cache, meta, 0.3, window, sinks)
        expected = reference_paged_attention(decode_q, cache, tables, [13, 9], 0.3, window, sinks)
        torch.testing.assert_close(out, expected, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


@pytest.mark.parametrize("cached", [0, 6])
def test_the_sink_attention_off_the_cpu_computes_what_the_flash_kernel_does(cached):
    """The path a non-CPU device takes (whole score matrices) against PyTorch's CPU flash kernel's output and
    logsumexp: causal from the start, and a chunk on a cached prefix under a window."""
    from llmpipe.layers.attention import _causal_mask, _flash_with_lse, _math_with_lse

    torch.manual_seed(1)
    q, k, v = torch.randn(4, 7, 16), torch.randn(4, 7 + cached, 16), torch.randn(4, 7 + cached, 16)
    mask = _causal_mask(cached, 7, 7 + cached, 5 if cached else None, "cpu")
    for ours, theirs in zip(_math_with_lse(q, k, v, mask, 0.3), _flash_with_lse(q, k, v, mask, 0.3)):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
