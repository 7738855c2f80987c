"""AWQ (Lin et al., 2023): activation-aware weight quantization.

Input channels that see large activations matter most. Scaling weight column j up by s_j before
round-to-nearest (and the input down by s_j) gives those columns finer steps; the product is
unchanged in float. s = mean|x|^α, with α from a grid over [0, 1] chosen to minimise the output
MSE of the quantized layer on calibration inputs. The 1/s folds into the op before the layer,
as AutoAWQ does for Llama (`LlamaAWQForCausalLM.get_layers_for_scaling`):
  input_layernorm → q/k/v;  v_proj → o_proj (only when v's outputs feed o's inputs one to one,
  i.e. no GQA);  post_attention_layernorm → gate/up;  up_proj → down_proj.
Then every linear is quantized round-to-nearest.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from llmpipe.quant.calibrate import LayerQuantizer, RunLayer, linear_modules
from llmpipe.quant.formats import Int4Weight
from llmpipe.quant.rtn import quantize_int4

N_GRID = 20  # α = 0, 1/20, …, 1
SEARCH_ROWS = 4096  # calibration rows the loss is measured on (x_mean uses all of them)


def search_scale(x: torch.Tensor, weight: torch.Tensor, group_size: int, n_grid: int = N_GRID) -> torch.Tensor:
    """The per-input-channel scale s [in] minimising ‖x Wᵀ − x (Q(W·s)/s)ᵀ‖² over the α grid."""
    x = x.reshape(-1, x.shape[-1]).float()
    x_mean = x.abs().mean(dim=0)
    if x.shape[0] > SEARCH_ROWS:
        x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:SEARCH_ROWS]]
    weight = weight.float()
    reference = x @ weight.T
    best_loss, best_scale = float("inf"), torch.ones_like(x_mean)
    for step in range(n_grid + 1):
        scale = x_mean.pow(step / n_grid).clamp(min=1e-4)
        scale = scale / (scale.max() * scale.min()).sqrt()
        dequantized = quantize_int4(weight * scale, group_size).dequantize() / scale
        loss = (x @ dequantized.T - reference).pow(2).mean().item()
        if loss < best_loss:
            best_loss, best_scale = loss, scale
    return best_scale


def search_layer_scales(layer: nn.Module, x: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """Scales for each linear of a decoder layer that has an op to fold them into, from its inputs x."""
    attn = layer.self_attn
    names = ["self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    if attn.num_heads == attn.num_kv_heads:  # v's outputs feed o's inputs one to one
        names.append("self_attn.o_proj")
    return {name: search_scale(x[name], layer.get_submodule(name).weight, group_size) for name in names}


def fold_scales(layer: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Weight columns × s, the op before ÷ s: the layer computes the same function in float."""
    attn, mlp = layer.self_attn, layer.mlp
    before = {
        "self_attn.qkv_proj": lambda s: layer.input_layernorm.weight.div_(s),
        "self_attn.o_proj": lambda s: _scale_rows(attn.qkv_proj, attn.q_size + attn.kv_size, 1 / s),
        "mlp.gate_up_proj": lambda s: layer.post_attention_layernorm.weight.div_(s),
        "mlp.down_proj": lambda s: _scale_rows(mlp.gate_up_proj, mlp.gate_up_proj.shard_sizes[0], 1 / s),
    }
    for name, scale in scales.items():
        before[name](scale)
        layer.get_submodule(name).weight.mul_(scale)


def awq_layer_quantizer(group_size: int) -> LayerQuantizer:
    def quantize(layer: nn.Module, run: RunLayer) -> dict[str, Int4Weight]:
        inputs: dict[str, list[torch.Tensor]] = defaultdict(list)
        run(lambda name, x: inputs[name].append(x))
        fold_scales(layer, search_layer_scales(layer, {name: torch.cat(rows) for name, rows in inputs.items()}, group_size))
        out = {}
        for name, module in linear_modules(layer).items():
            out[name] = quantize_int4(module.weight, group_size)
            module.weight.copy_(out[name].dequantize())
        return out

    return quantize


def _scale_rows(linear: nn.Linear, first_row: int, factor: torch.Tensor) -> None:
    """Multiply output rows first_row… (v of q/k/v, up of gate/up) and their bias by factor."""
    linear.weight[first_row:].mul_(factor[:, None])
    if linear.bias is not None:
        linear.bias[first_row:].mul_(factor)
