"""AWQ: the scale search beats round-to-nearest where activations have outlier channels, the
clipping search finds what trying every shrink ratio per group finds, and folding the scales into
the previous op leaves the float model's function unchanged."""

import pytest
import torch
from torch import nn

from llmpipe import LLM
from llmpipe.quant.awq import MAX_SHRINK, N_GRID, fold_scales, search_clip, search_scale
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


def linear_of(w: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data.copy_(w)
    return linear


def test_awq_scales_cut_the_output_error_of_round_to_nearest():
    x = outlier_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    linear = linear_of(w)
    scale = search_scale(list(x.split(256)), linear, linear, group_size=32)
    assert torch.equal(linear.weight, w)  # the search leaves the weight as it found it
    awq = quantize_int4(w * scale, 32).dequantize() / scale
    rtn = quantize_int4(w, 32).dequantize()
    assert output_error(x, w, awq) < 0.5 * output_error(x, w, rtn)
    assert scale.shape == (128,) and (scale > 0).all()


def test_without_outliers_awq_never_does_worse_than_round_to_nearest():
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(2))
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    linear = linear_of(w)
    scale = search_scale([x], linear, linear, group_size=16)
    awq = quantize_int4(w * scale, 16).dequantize() / scale
    assert output_error(x, w, awq) <= output_error(x, w, quantize_int4(w, 16).dequantize()) * (1 + 1e-6)


def test_scales_are_judged_on_the_block_output():
    """Behind the linear, a block that reads only outputs 0 and 1: scored on the block, the search
    serves those outputs better than when scored on the whole linear."""
    x = outlier_inputs(rows=1024, dim=64, seed=9)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(10))
    linear = linear_of(w)
    errors = []
    for block in (lambda t: linear(t)[:, :2], linear):
        scale = search_scale([x], linear, block, group_size=16)
        errors.append(output_error(x, w[:2], (quantize_int4(w * scale, 16).dequantize() / scale)[:2]))
    assert errors[0] < 0.8 * errors[1]


@pytest.mark.parametrize("in_features", [48, 64])  # 48: a last group narrower than 32
def test_clipping_search_matches_trying_every_ratio_per_group(in_features):
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(256, in_features, generator=gen), torch.randn(8, in_features, generator=gen)
    w[:, 3] *= 6  # an outlier weight worth clipping
    best = search_clip(x, w, group_size=32)
    for row in range(w.shape[0]):
        for g, start in enumerate(range(0, in_features, 32)):
            xs, ws = x[:, start : start + 32], w[row : row + 1, start : start + 32]
            top = ws.abs().max()
            errors = []
            for step in range(int(MAX_SHRINK * N_GRID)):
                bound = top * (1 - step / N_GRID)
                q = quantize_int4(ws.clamp(-bound, bound), 32).dequantize()
                errors.append(((xs @ q.T - xs @ ws.T) ** 2).mean().item())
            expected = top * (1 - min(range(len(errors)), key=errors.__getitem__) / N_GRID)
            torch.testing.assert_close(best[row, g], expected, rtol=1e-6, atol=0)


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
