"""AWQ: the scale search beats round-to-nearest where activations have outlier channels, and
folding the scales into the previous op leaves the float model's function unchanged."""

import pytest
import torch

from llmpipe import LLM
from llmpipe.quant.awq import fold_scales, search_scale
from llmpipe.quant.rtn import quantize_int4

PROMPT = [1, 17, 250, 33, 91, 5, 160, 77, 300, 12, 64, 128, 3, 99, 201, 45]


def outlier_inputs(rows=2048, dim=128, seed=0) -> torch.Tensor:
    """Activations where a few channels are ~30x larger than the rest (what AWQ is built for)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen)
    x[:, torch.randperm(dim, generator=gen)[:4]] *= 30
    return x


def output_error(x, w, w_hat) -> float:
    return (x @ (w_hat - w).T).pow(2).mean().item()


def test_awq_scales_cut_the_output_error_of_round_to_nearest():
    x = outlier_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    scale = search_scale(x, w, group_size=32)
    awq = quantize_int4(w * scale, 32).dequantize() / scale
    rtn = quantize_int4(w, 32).dequantize()
    assert output_error(x, w, awq) < 0.5 * output_error(x, w, rtn)
    assert scale.shape == (128,) and (scale > 0).all()


def test_without_outliers_awq_never_does_worse_than_round_to_nearest():
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(2))
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    scale = search_scale(x, w, group_size=16)
    awq = quantize_int4(w * scale, 16).dequantize() / scale
    assert output_error(x, w, awq) <= output_error(x, w, quantize_int4(w, 16).dequantize()) * (1 + 1e-6)


@pytest.mark.parametrize("name", ["llama_mha", "llama_gqa", "qwen2"])
def test_folded_scales_leave_the_float_model_unchanged(tiny_checkpoint, name):
    llm = LLM(str(tiny_checkpoint(name)), progress=False, quantization=None)
    before = llm.engine.score(PROMPT)
    weights_before = [p.clone() for p in llm.engine.model.parameters()]
    gen = torch.Generator().manual_seed(0)
    for layer in llm.engine.model.model.layers:
        names = ["self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"]
        if layer.self_attn.num_heads == layer.self_attn.num_kv_heads:
            names.append("self_attn.o_proj")
        scales = {n: torch.rand(layer.get_submodule(n).in_features, generator=gen) * 4 + 0.25 for n in names}
        fold_scales(layer, scales)
    changed = sum(not torch.equal(a, b) for a, b in zip(weights_before, llm.engine.model.parameters()))
    assert changed >= 5 * len(llm.engine.model.model.layers)  # 2 norms, qkv, gate_up, down (+ o under MHA)
    torch.testing.assert_close(llm.engine.score(PROMPT), before, atol=1e-4, rtol=1e-4)
