"""Calibration: running a model's decoder layers one at a time on sample token windows (GPTQ, AWQ).

Each layer's input is the previous layer's output computed *after* that layer was quantized, so
every layer is quantized against the error that actually reaches it.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from llmpipe.errors import InvalidRequestError
from llmpipe.quant.formats import Int4Weight
from llmpipe.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Observer = Callable[[str, torch.Tensor], None]  # (linear's name in the layer, its input rows)
RunLayer = Callable[[Observer], None]  # runs the layer on every sample, showing each linear's inputs
Attend = Callable[[torch.Tensor], torch.Tensor]  # the layer's self-attention on one sample's normed hidden states
LayerQuantizer = Callable[[nn.Module, RunLayer, Attend], dict[str, Int4Weight]]


def calibration_samples(tokenizer: Tokenizer, text: str, num_samples: int, seq_len: int) -> torch.Tensor:
    """Up to num_samples non-overlapping windows of seq_len tokens, spread evenly over the text: [n, seq_len]."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    windows = len(ids) // seq_len
    if windows == 0:
        raise InvalidRequestError(f"the calibration text has {len(ids)} tokens, fewer than seq_len={seq_len}")
    if windows < num_samples:
        logger.warning("calibration text holds only %d windows of %d tokens (asked for %d)", windows, seq_len, num_samples)
    chunks = torch.tensor(ids[: windows * seq_len]).view(windows, seq_len)
    return chunks[torch.linspace(0, windows - 1, min(num_samples, windows)).round().long()]


def linear_modules(layer: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in layer.named_modules() if isinstance(module, nn.Linear)}


@torch.no_grad()
def quantize_layers(engine, samples: torch.Tensor, quantize_layer: LayerQuantizer, desc: str) -> dict[str, Int4Weight]:
    """Quantize every decoder layer of engine.model in turn; {module name: weight}, e.g.
    "model.layers.0.self_attn.qkv_proj". quantize_layer leaves the layer computing with the
    dequantized weights, so the next layer's inputs carry the quantization error."""
    model = engine.model
    seq_len = samples.shape[1]
    results: dict[str, Int4Weight] = {}
    with engine.scratch_blocks([0] * seq_len) as block_tables:
        metas = engine.core.runner.prefill_metadata(block_tables, seq_len)  # one per layer
        hidden = [model.model.embed_tokens(ids) for ids in samples]
        rope = model.model.rotary.tables(torch.arange(seq_len), hidden[0].dtype)
        layers = zip(model.model.layers, engine.core.runner.kv_cache.layers, metas)
        for i, (layer, kv_cache, meta) in enumerate(tqdm(layers, total=len(model.model.layers), desc=desc, unit="layer")):

            def run(observe: Observer, layer=layer, kv_cache=kv_cache, meta=meta) -> None:
                hooks = [
                    module.register_forward_hook(lambda _m, args, _out, name=name: observe(name, args[0]))
                    for name, module in linear_modules(layer).items()
                ]
                try:
                    for h in hidden:
                        layer(h, rope, kv_cache, meta)
                finally:
                    for hook in hooks:
                        hook.remove()

            def attend(x: torch.Tensor, layer=layer, kv_cache=kv_cache, meta=meta) -> torch.Tensor:
                return layer.self_attn(x, rope, kv_cache, meta)

            for name, weight in quantize_layer(layer, run, attend).items():
                results[f"model.layers.{i}.{name}"] = weight
            hidden = [layer(h, rope, kv_cache, meta) for h in hidden]
    return results
