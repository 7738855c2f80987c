"""AWQ (Lin et al., 2023): activation-aware weight quantization, as AutoAWQ runs it (`AwqQuantizer`).

Input channels that see large activations matter most. Scaling weight column j up by s_j before
round-to-nearest (and the input down by s_j) gives those columns finer steps; the product is
unchanged in float. Per decoder layer, for each group of linears sharing an input:
  1. scale search: s = mean|x|^α / mean(|w| / max|w| of its group)^(1-α) (AutoAWQ's `duo_scaling`),
     normalised, for α on a grid over [0, 1), plus s = 1 (plain round-to-nearest); the winner
     minimises the MSE of the *block's* output — the attention block for q/k/v, the MLP for
     gate/up, the linear itself for o_proj and down_proj — with the group's weights quantized;
  2. the 1/s folds into the op before (`get_layers_for_scaling` for Llama): input_layernorm →
     q/k/v; v_proj → o_proj (only without GQA, where v's outputs feed o's inputs one to one);
     post_attention_layernorm → gate/up; up_proj → down_proj;
  3. clipping search: per weight group, the largest |w| is shrunk by 0 … 45% and the ratio that
     minimises the MSE of that group's share of W·X is kept (not for q and k: their errors are
     amplified by the attention softmax);
  4. round-to-nearest.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.quant.calibrate import Attend, LayerQuantizer, RunLayer, linear_modules
from llmpipe.quant.formats import Int4Weight
from llmpipe.quant.rtn import pad_groups, quantize_int4

N_GRID = 20  # α = 0, 1/20, …, 19/20; shrink ratios 0, 1/20, … below MAX_SHRINK
MAX_SHRINK = 0.5
SEARCH_SAMPLES = 8  # calibration windows each scale candidate is scored on (mean|x| uses all of them)
CLIP_TOKENS = 2048  # calibration rows each clipping candidate is scored on
CLIP_ROWS = 512  # output rows per clipping batch (bounds memory: groups × tokens × rows floats)

Block = Callable[[torch.Tensor], torch.Tensor]  # one sample's input of the scaled linear → the block's output


def scale_blocks(layer: nn.Module, attend: Attend) -> dict[str, Block]:
    """The scaled linears of a decoder layer and the blocks whose outputs judge their scales."""
    attn, mlp = layer.self_attn, layer.mlp
    blocks = {"self_attn.qkv_proj": attend, "mlp.gate_up_proj": mlp, "mlp.down_proj": mlp.down_proj}
    if attn.num_heads == attn.num_kv_heads:  # v's outputs feed o's inputs one to one
        blocks["self_attn.o_proj"] = attn.o_proj
    return blocks


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, n_grid: int = N_GRID) -> list[torch.Tensor]:
    """s = 1, then AutoAWQ's x_mean^α / w_mean^(1-α) for α = 0, 1/n, …, (n-1)/n, each normalised."""
    candidates = [torch.ones_like(x_mean)]
    for step in range(n_grid):
        ratio = step / n_grid
        scale = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        candidates.append(scale / (scale.max() * scale.min()).sqrt())
    return candidates


def weight_mean(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per input channel: the mean over rows of |w| relative to the largest |w| of its group."""
    groups = pad_groups(weight.abs().float(), group_size)
    relative = (groups / (groups.amax(dim=-1, keepdim=True) + 1e-6)).flatten(1)[:, : weight.shape[1]]
    return relative.mean(dim=0)


@torch.no_grad()
def search_scale(inputs: list[torch.Tensor], linear: nn.Linear, block: Block, group_size: int) -> torch.Tensor:
    """The per-input-channel scale s [in] minimising the MSE of block's output over calibration
    samples `inputs` (each [tokens, in]) when linear's weight is replaced by Q(W·s)/s."""
    x_mean = torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs]).abs().float().mean(dim=0)
    samples = inputs[:: max(1, len(inputs) // SEARCH_SAMPLES)][:SEARCH_SAMPLES]
    original = linear.weight.detach().clone()
    references = [block(x) for x in samples]
    best_loss, best_scale = float("inf"), None
    try:
        for scale in candidate_scales(x_mean, weight_mean(original, group_size)):
            linear.weight.copy_(quantize_int4(original * scale, group_size).dequantize() / scale)
            loss = sum((block(x) - ref).float().pow(2).sum().item() for x, ref in zip(samples, references))
            if loss < best_loss:
                best_loss, best_scale = loss, scale
    finally:
        linear.weight.copy_(original)
    return best_scale


@torch.no_grad()
def search_clip(x: torch.Tensor, weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per (row, group) the max |w| [out, groups] minimising ‖X_g W_gᵀ − X_g Q(clamp(W_g))ᵀ‖² over
    rows x [tokens, in]: AutoAWQ's `_compute_best_clip`, with each group's product as a batched matmul."""
    groups = -(-weight.shape[1] // group_size)
    xg = F.pad(x.float(), (0, groups * group_size - x.shape[1])).view(x.shape[0], groups, group_size).transpose(0, 1)
    best = []
    for rows in pad_groups(weight.float(), group_size).split(CLIP_ROWS):  # [rows, groups, group_size]
        reference = torch.bmm(xg, rows.permute(1, 2, 0))  # [groups, tokens, rows]
        original_max = rows.abs().amax(dim=-1)  # [rows, groups]
        best_max, best_err = original_max.clone(), torch.full_like(original_max, float("inf"))
        for step in range(int(MAX_SHRINK * N_GRID)):
            max_val = original_max * (1 - step / N_GRID)
            clipped = torch.clamp(rows, -max_val[..., None], max_val[..., None])
            q = quantize_int4(clipped.flatten(1), group_size).dequantize().view_as(rows)
            err = (torch.bmm(xg, q.permute(1, 2, 0)) - reference).pow(2).mean(dim=1).T  # [rows, groups]
            better = err < best_err
            best_err, best_max = torch.where(better, err, best_err), torch.where(better, max_val, best_max)
        best.append(best_max)
    return torch.cat(best)


def apply_clip(weight: torch.Tensor, max_val: torch.Tensor, group_size: int) -> None:
    bound = max_val.repeat_interleave(group_size, dim=1)[:, : weight.shape[1]]
    torch.clamp(weight, -bound, bound, out=weight)


def clip_rows(layer: nn.Module) -> dict[str, slice]:
    """The rows of each linear that may be clipped: all but q's and k's."""
    attn = layer.self_attn
    return {name: slice(attn.q_size + attn.kv_size, None) if name == "self_attn.qkv_proj" else slice(None)
            for name in linear_modules(layer)}


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
    @torch.no_grad()
    def quantize(layer: nn.Module, run: RunLayer, attend: Attend) -> dict[str, Int4Weight]:
        inputs: dict[str, list[torch.Tensor]] = defaultdict(list)
        run(lambda name, x: inputs[name].append(x.detach().float()))
        scales = {
            name: search_scale(inputs[name], layer.get_submodule(name), block, group_size)
            for name, block in scale_blocks(layer, attend).items()
        }
        fold_scales(layer, scales)
        out, clippable = {}, clip_rows(layer)
        for name, module in linear_modules(layer).items():
            rows = clippable[name]
            x = _spread_rows(inputs[name], CLIP_TOKENS)
            if name in scales:
                x = x / scales[name]
            weight = module.weight[rows]
            apply_clip(weight, search_clip(x, weight, group_size), group_size)
            out[name] = quantize_int4(module.weight, group_size)
            module.weight.copy_(out[name].dequantize())
        return out

    return quantize


def _spread_rows(inputs: list[torch.Tensor], count: int) -> torch.Tensor:
    """About `count` rows taken evenly from all the samples' rows."""
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs])
    return x[:: max(1, x.shape[0] // count)][:count]


def _scale_rows(linear: nn.Linear, first_row: int, factor: torch.Tensor) -> None:
    """Multiply output rows first_row… (v of q/k/v, up of gate/up) and their bias by factor."""
    linear.weight[first_row:].mul_(factor[:, None])
    if linear.bias is not None:
        linear.bias[first_row:].mul_(factor)
