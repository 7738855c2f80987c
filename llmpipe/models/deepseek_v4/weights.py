"""DeepSeek V4's checkpoint names ↔ llmpipe's parameters, and loading the tensors in.

transformers' save_pretrained writes DeepSeek's own names under `model.` ("model.layers.3.attn.wq_a.weight",
"model.layers.3.ffn.experts.7.w1.weight", "head.weight"), which its conversion mapping renames on load;
LAYER_NAMES is that mapping as one table. Routed experts come one matrix per expert and fill slices of the
3-D expert tensors (w1 | w3 stacked as gate_up, w2 as down); the shared expert's w1 / w3 fill the halves
of its stacked gate_up matrix. (The published checkpoints use the same names without the leading
`model.`, most weights in FP8: not read here.) Multi-token-prediction tensors (`mtp.*`) are never read.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from llmpipe.errors import ModelLoadError
from llmpipe.models.weights import _check_shape, _shard_rows
from llmpipe.quant.formats import QuantizedWeight
from llmpipe.quant.linear import QuantizedLinear

# Parameter under model.layers.N. → checkpoint tensor under model.layers.N.
LAYER_NAMES = {
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
FROM_CHECKPOINT = {ckpt: param for param, ckpt in LAYER_NAMES.items()}
SHARED_GATE_UP = "mlp.shared_experts.gate_up_proj.weight"
EXPERT_GATE_UP, EXPERT_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
_LAYER = re.compile(r"(model\.layers\.\d+\.)(.+)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.w([123])\.weight")
_SHARED = re.compile(r"ffn\.shared_experts\.w([13])\.weight")
_HALF = {"1": 0, "3": 1}  # w1 = gate (first half of gate_up), w3 = up

Place = tuple[str, int | None, int | None]  # parameter, expert index, half of a stacked gate | up


def locate(name: str) -> Place | None:
    """Checkpoint name → where it goes; None if the model has no place for it."""
    if name == "head.weight":
        return "lm_head.weight", None, None
    match = _LAYER.fullmatch(name)
    if match is None:
        return name, None, None  # embedding, final norm, hyper-connection head keep their names
    prefix, local = match.groups()
    if expert := _EXPERT.fullmatch(local):
        param = EXPERT_DOWN if expert[2] == "2" else EXPERT_GATE_UP
        return prefix + param, int(expert[1]), _HALF.get(expert[2])
    if shared := _SHARED.fullmatch(local):
        return prefix + SHARED_GATE_UP, None, _HALF[shared[1]]
    return (prefix + FROM_CHECKPOINT[local], None, None) if local in FROM_CHECKPOINT else None


def checkpoint_tensors(param: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors that fill one parameter, with their shapes (locate's inverse)."""
    if param == "lm_head.weight":
        return {"head.weight": shape}
    match = _LAYER.fullmatch(param)
    if match is None:
        return {param: shape}
    prefix, local = match.groups()
    if local == EXPERT_GATE_UP:
        experts, rows, cols = shape
        return {f"{prefix}ffn.experts.{e}.w{w}.weight": (rows // 2, cols) for e in range(experts) for w in (1, 3)}
    if local == EXPERT_DOWN:
        return {f"{prefix}ffn.experts.{e}.w2.weight": shape[1:] for e in range(shape[0])}
    if local == SHARED_GATE_UP:
        return {f"{prefix}ffn.shared_experts.w{w}.weight": (shape[0] // 2, shape[1]) for w in (1, 3)}
    return {prefix + LAYER_NAMES[local]: shape}


def model_tensors(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model loads, with its shape, in model order."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    shapes |= {f"{path}.weight": (m.out_features, m.in_features) for path, m in _quantized(model).items()}
    return {ckpt: s for param, shape in shapes.items() for ckpt, s in checkpoint_tensors(param, shape).items()}


@torch.no_grad()
def load_deepseek_v4_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
    params, quantized = dict(model.named_parameters()), _quantized(model)
    expected, loaded = set(model_tensors(model)), set()
    for name, tensor in weights:
        place = locate(name) if name in expected else None
        if place is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the deepseek_v4 model")
        target, expert, half = place
        module = quantized.get(target.removesuffix(".weight"))
        if module is not None:
            _check_shape(name, tensor, (_shard_rows(module, half), module.in_features))
            module.load_shard(half, tensor)
        else:
            dense = tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()
            _copy(params[target].data, expert, half, dense, name)
        loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[0]!r}")


def _copy(dest: torch.Tensor, expert: int | None, half: int | None, tensor: torch.Tensor, name: str) -> None:
    if expert is not None:
        dest = dest[expert]
    if half is not None:
        rows = dest.shape[0] // 2
        dest = dest.narrow(0, half * rows, rows)
    _check_shape(name, tensor, tuple(dest.shape))
    dest.copy_(tensor)


def _quantized(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {path: m for path, m in model.named_modules() if isinstance(m, QuantizedLinear)}
