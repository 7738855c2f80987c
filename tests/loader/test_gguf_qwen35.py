"""A Qwen3.5 GGUF as llama.cpp's converter writes one (its Qwen3_5TextModel): value heads reordered from grouped by
key head to tiled (in_proj_qkv's V rows, z, b, a, A_log, dt_bias, the conv's V channels, out_proj's columns), the
zero-centred norms stored as 1 + weight (the gated norm not), A_log as −exp(A_log), the conv weight squeezed, and
the partial RoPE and layer pattern in metadata. Float, or Q8_0 matrices read in place by the GGML kernels, it is
transformers' model."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmpipe import LLM
from llmpipe.quant.linear import GGMLLinear
from tests.loader.gguf_helpers import hf_metadata, split_experts, write_gguf
from tests.models.parity_suite import GREEDY, PROMPT
from tests.utils import reference_greedy

ARCH = "qwen35"


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3_5"), dtype=torch.float32).eval()


def tiled(tensor: torch.Tensor, dim: int, key_heads: int, per_key: int, head_dim: int) -> torch.Tensor:
    """Value heads grouped by key head [K, r, d] → tiled [r, K, d] along `dim` (the converter's _reorder_v_heads)."""
    shape = list(tensor.shape)
    grouped = tensor.reshape(*shape[:dim], key_heads, per_key, head_dim, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def reorder_v_heads(kind: str, t: torch.Tensor, K: int, r: int, qk: int, dv: int) -> torch.Tensor:
    """A linear layer's tensor with its value heads tiled (the converter's _LinearAttentionVReorderBase)."""
    if kind in ("in_proj_qkv.weight", "conv1d.weight"):
        return torch.cat([t[:qk], tiled(t[qk:], 0, K, r, dv)])
    if kind == "in_proj_z.weight":
        return tiled(t, 0, K, r, dv)
    if kind in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return tiled(t, 0, K, r, 1)
    return tiled(t, 1, K, r, dv) if kind == "out_proj.weight" else t


def converter_tensors(model, quantized: bool, arch: gguf.MODEL_ARCH = gguf.MODEL_ARCH.QWEN35,
                      state: dict[str, torch.Tensor] | None = None) -> dict:
    """`state` (default: the model's), as the converter writes it for `arch`: experts merged into 3-D tensors, value
    heads tiled but for qwen3next (whose Qwen3NextModel keeps Hugging Face's order)."""
    c = model.config
    K, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    qk, dv = 2 * K * c.linear_key_head_dim, c.linear_value_head_dim
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    tensors = {}
    for hf_name, t in split_experts(model.state_dict() if state is None else state).items():
        t = t.float()
        if ".linear_attn." in hf_name:
            kind = hf_name.rpartition("linear_attn.")[2]
            t = t.squeeze(1) if kind == "conv1d.weight" else t
            t = t if arch == gguf.MODEL_ARCH.QWEN3NEXT else reorder_v_heads(kind, t, K, r, qk, dv)
            if kind == "A_log":
                t = -torch.exp(t)
            if kind == "dt_bias":
                hf_name = hf_name.replace("dt_bias", "dt_proj.bias")
        if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            t = t + 1
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = t.numpy()
        big = t.dim() == 2 and t.shape[1] % 32 == 0 and "token_embd" not in name
        tensors[name] = (data, Q.Q8_0) if quantized and big else data
    return tensors


def converter_metadata(config, arch: str = ARCH) -> dict:
    head_dim = config.head_dim
    return hf_metadata(config, arch) | {
        f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
        f"{arch}.ssm.conv_kernel": config.linear_conv_kernel_dim, f"{arch}.ssm.state_size": config.linear_key_head_dim,
        f"{arch}.ssm.group_count": config.linear_num_key_heads, f"{arch}.ssm.time_step_rank": config.linear_num_value_heads,
        f"{arch}.ssm.inner_size": config.linear_value_head_dim * config.linear_num_value_heads,
        f"{arch}.attention.recurrent_layers": [t == "linear_attention" for t in config.layer_types],
        f"{arch}.full_attention_interval": 4,
        f"{arch}.rope.dimension_count": int(head_dim * config.rope_parameters["partial_rotary_factor"]),
        f"{arch}.rope.dimension_sections": [11, 11, 10, 0],
    }


def test_a_qwen35_gguf_is_transformers_model(reference, tmp_path):
    path = write_gguf(tmp_path / "qwen35.gguf", ARCH, converter_metadata(reference.config), converter_tensors(reference, False))
    llm = LLM(str(path), progress=False, activation_quantization=None)
    assert llm.engine.model.model.layers[0].linear_attn.tiled
    assert llm.engine.config.model_config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(llm.engine.score(PROMPT), theirs, atol=1e-4, rtol=0)
    ours = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids
    assert ours == reference_greedy(reference, PROMPT)[0]


def test_q8_0_matrices_are_read_in_place_and_compute_their_dequantized_values(reference, tmp_path):
    """The Q8_0 file's projections (the linear layers' four stacked into one) stay GGML blocks; its logits are those
    of a float file holding gguf-py's dequantization of the same blocks."""
    quantized = converter_tensors(reference, True)
    dequantized = {name: gguf.quants.dequantize(gguf.quants.quantize(t[0], t[1]), t[1]) if isinstance(t, tuple) else t
                   for name, t in quantized.items()}
    metadata = converter_metadata(reference.config)
    q8, exact = (LLM(str(write_gguf(tmp_path / f"{name}.gguf", ARCH, metadata, tensors)), progress=False,
                     activation_quantization=None) for name, tensors in (("q8", quantized), ("f32", dequantized)))
    layer = q8.engine.model.model.layers[0]
    assert isinstance(layer.linear_attn.in_proj, GGMLLinear) and isinstance(layer.linear_attn.out_proj, GGMLLinear)
    torch.testing.assert_close(q8.engine.score(PROMPT), exact.engine.score(PROMPT), atol=1e-4, rtol=0)
