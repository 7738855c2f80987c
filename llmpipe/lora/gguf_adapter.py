"""Reading a llama.cpp GGUF LoRA file (what its convert_lora_to_gguf.py writes from a PEFT directory).

The file says general.type = "adapter", adapter.type = "lora" and adapter.lora.alpha; each adapted weight
`blk.N.attn_q.weight` has `blk.N.attn_q.weight.lora_a` ([r, in]) and `.lora_b` ([out, r]), named by the base
architecture's GGUF table (the model family's, as for base weights). llama.cpp scales by alpha / r (1 where
alpha is 0), whatever rsLoRA said. For the "llama" GGUF architecture the converter permuted the rows of
attn_q / attn_k as it does the base weights', which for a LoRA pair moves lora_b's rows: they are put back
here as the loader puts back the base weights' (loader/gguf_names.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.gguf_file import metadata, open_gguf, tensor_shape
from llmpipe.loader.gguf_names import pattern_of, unpermute_rows
from llmpipe.loader.gguf_quants import SUPPORTED_TYPES, dequantize
from llmpipe.lora.adapter import LoRAAdapter
from llmpipe.lora.targets import LoRATargets
from llmpipe.models.registry import family_of

SUFFIXES = {".lora_a": "a", ".lora_b": "b"}


def read_gguf_adapter(name: str, path: Path, targets: LoRATargets) -> LoRAAdapter:
    reader = open_gguf(path)
    kind, adapter_type = metadata(reader, path, "general.type", None), metadata(reader, path, "adapter.type", None)
    if kind != "adapter" or adapter_type != "lora":
        raise UnsupportedModelError(f"{path}: not a GGUF LoRA adapter (general.type {kind!r}, adapter.type {adapter_type!r})")
    if metadata(reader, path, "adapter.alora.invocation_tokens", None) is not None:
        raise UnsupportedModelError(f"{path}: an activated LoRA (alora), which llmpipe does not serve")
    arch_name = metadata(reader, path, "general.architecture")
    family = family_of(targets.config.architecture)
    arch = family.gguf.get(arch_name)
    if arch is None:
        raise UnsupportedModelError(f"{path}: an adapter for GGUF architecture {arch_name!r}, not this "
                                    f"{targets.config.architecture} model's family ({family.name})")
    alpha = float(metadata(reader, path, "adapter.lora.alpha", 0.0))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        base, suffix = _split(tensor.name)
        if suffix is None:
            raise UnsupportedModelError(f"{path}: tensor {tensor.name} is not a LoRA factor, which llmpipe does not serve")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, "
                                        "which llmpipe cannot read")
        hf_name = arch.hf_name(base)
        if hf_name is None or not hf_name.endswith(".weight"):
            raise UnsupportedModelError(f"{path}: the adapter changes {base}, which llmpipe does not adapt")
        targets.check_shape(hf_name.removesuffix(".weight"), suffix.upper(), tuple(tensor_shape(tensor)), path)  # before reading
        value = dequantize(torch.from_numpy(tensor.data), tensor.tensor_type, tensor_shape(tensor)).to(torch.float32, copy=True)
        if suffix == "b" and (heads := arch.permuted.get(pattern_of(base)[0])) is not None:
            value = unpermute_rows(value, getattr(targets.config, heads))
        pairs.setdefault(hf_name.removesuffix(".weight"), {})[suffix] = value
    factors = {}
    for module, pair in pairs.items():
        if set(pair) != {"a", "b"}:
            raise UnsupportedModelError(f"{path}: {module} has one LoRA factor without the other")
        rank = pair["a"].shape[0]
        factors[module] = (pair["a"], pair["b"] * (alpha / rank if alpha else 1.0))
    return targets.assemble(name, factors, path)


def _split(name: str) -> tuple[str, str | None]:
    for suffix, which in SUFFIXES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix), which
    return name, None
