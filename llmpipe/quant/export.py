"""Writing a quantized model as a Hugging Face directory in the GPTQ or AWQ layout: config.json with
`quantization_config`, model.safetensors, and the tokenizer files.

Stacked modules (qkv_proj, gate_up_proj) are split back into their checkpoint tensors (q_proj,
k_proj, v_proj, …) by row; unquantized tensors (embeddings, norms, an untied LM head, biases)
are written in float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.loader.hf_config import hf_config_dict
from llmpipe.models.llama.model import STACKED_PARAMS
from llmpipe.models.weights import shards
from llmpipe.quant.formats import Int4Weight
from llmpipe.quant.packing import PACK, pack_awq, pack_gptq
from llmpipe.tokenizer import Tokenizer
from llmpipe.tokenizer.hf_tokenizer import save_hf_tokenizer

LAYOUTS = {"gptq": pack_gptq, "awq": pack_awq}


def quantization_config(layout: str, group_size: int, act_order: bool = False, damp_percent: float = 0.01) -> dict:
    """`quantization_config` as AutoGPTQ (v1 checkpoint format) / AutoAWQ (GEMM) write it."""
    if layout == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": False,
        "damp_percent": damp_percent, "true_sequential": False, "static_groups": False, "checkpoint_format": "gptq",
    }


def checkpoint_tensors(model: nn.Module, quantized: dict[str, Int4Weight]) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """(checkpoint name, tensor) of every parameter, with the weights of modules in `quantized`
    (module name → weight) replaced by their quantized form."""
    for name, param in model.named_parameters():
        module_name, kind = name.rsplit(".", 1)
        for prefix, rows in shards(module_name, model.get_submodule(module_name), STACKED_PARAMS):
            if kind == "weight" and module_name in quantized:
                yield f"{prefix}.weight", _take_rows(quantized[module_name], rows)
            else:
                yield f"{prefix}.{kind}", param.detach()[rows]


def save_quantized(
    directory: Path, model: nn.Module, config: ModelConfig, tokenizer: Tokenizer | None,
    quantized: dict[str, Int4Weight], quant_config: dict,
) -> None:
    pack = LAYOUTS[quant_config["quant_method"]]
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint_tensors(model, quantized):
        if isinstance(tensor, Int4Weight):
            _check_packable(name, tensor)
            prefix = name.removesuffix(".weight")
            tensors.update({f"{prefix}.{part}": value for part, value in pack(tensor).items()})
        else:
            tensors[name] = tensor.float().contiguous().clone()  # clone: safetensors refuses shared storage
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf_config = hf_config_dict(config) | {"torch_dtype": "float32", "quantization_config": quant_config}
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, directory)


def _take_rows(weight: Int4Weight, rows: slice) -> Int4Weight:
    return Int4Weight(weight.q[rows], weight.scale[rows], weight.offset[rows], weight.group_size, weight.in_perm)


def _check_packable(name: str, weight: Int4Weight) -> None:
    out_features, in_features = weight.shape
    if out_features % PACK or in_features % PACK:
        raise ValueError(f"{name}: shape {list(weight.shape)} does not pack 8 values per int32 (needs multiples of 8)")
