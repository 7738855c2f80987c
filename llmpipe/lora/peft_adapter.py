"""Reading a PEFT LoRA directory: adapter_config.json and adapter_model.safetensors (never a pickle).

Tensors are named `base_model.model.<checkpoint module>.lora_A.weight` ([r, in]) and `.lora_B.weight`
([out, r]); the update is scale · B @ A with scale = alpha / r, or alpha / sqrt(r) under use_rslora, where
alpha_pattern may give a module its own alpha (rank_pattern its own r, which the tensors' shapes say too).
What llmpipe cannot serve is refused in one line: DoRA, modules_to_save, LoRA biases, embedding or LM-head
targets, modules the model does not have, other PEFT methods.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from llmpipe.errors import LLMPipeError, ModelLoadError, UnsupportedModelError
from llmpipe.lora.adapter import LoRAAdapter
from llmpipe.lora.targets import LoRATargets

CONFIG, WEIGHTS, PICKLED = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"
PREFIX = "base_model.model."
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


def read_peft_adapter(name: str, directory: Path, targets: LoRATargets) -> LoRAAdapter:
    config = _read_config(directory)
    weights = directory / WEIGHTS
    if not weights.is_file():
        if (directory / PICKLED).is_file():
            raise UnsupportedModelError(f"{directory}: {PICKLED} is a pickle, which llmpipe never loads; save the adapter "
                                        "with safe_serialization (adapter_model.safetensors)")
        raise ModelLoadError(f"{directory}: no {WEIGHTS}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():  # every shape checked before any tensor is read
                module, which = _parse(key, directory)
                targets.check_shape(module, which, tuple(f.get_slice(key).get_shape()), directory)
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except LLMPipeError:
        raise
    except Exception as exc:  # safetensors raises its own SafetensorError (an Exception) on a bad file
        raise ModelLoadError(f"{weights}: not a readable safetensors file: {exc}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, which = _parse(key, directory)
        pairs.setdefault(module, {})[which] = tensor
    factors = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ModelLoadError(f"{weights}: {module} has lora_{next(iter(pair))} without its other factor")
        a, b = pair["A"].float(), pair["B"].float()
        factors[module] = (a, b * _scale(config, module, a.shape[0]))
    return targets.assemble(name, factors, directory)


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG
    if not path.is_file():
        raise ModelLoadError(f"{directory}: not a PEFT adapter directory (no {CONFIG})")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not readable JSON: {exc}") from exc
    peft_type = config.get("peft_type", "LORA")
    refusals = [
        (peft_type != "LORA", f"peft_type {peft_type!r} (only LORA adapters are supported)"),
        (config.get("use_dora"), "a DoRA adapter (use_dora), which llmpipe does not serve"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')} (whole trained modules), "
                                        "which llmpipe does not serve"),
        (config.get("bias", "none") != "none" or config.get("lora_bias"), "trained biases, which llmpipe does not serve"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out (GPT-2 style Conv1D weights), which llmpipe's models do not have"),
        (config.get("target_parameters"), "target_parameters (LoRA on raw parameters), which llmpipe does not serve"),
        (config.get("alora_invocation_tokens"), "an activated LoRA (alora_invocation_tokens), which llmpipe does not serve"),
    ]
    for refused, what in refusals:
        if refused:
            raise UnsupportedModelError(f"{directory}: {what}")
    if "lora_alpha" not in config:
        raise ModelLoadError(f"{path}: no lora_alpha")
    return config


def _parse(key: str, directory: Path) -> tuple[str, str]:
    """A tensor's (checkpoint module name, "A" or "B"); anything but LoRA factors is refused."""
    name = key.removeprefix(PREFIX)
    if "lora_magnitude_vector" in name:
        raise UnsupportedModelError(f"{directory}: {key} is a DoRA magnitude, which llmpipe does not serve")
    if "lora_embedding_" in name:
        raise UnsupportedModelError(f"{directory}: {key} adapts an embedding; llmpipe adapts linear layers only")
    match = _FACTOR.match(name)
    if match is None:
        raise UnsupportedModelError(f"{directory}: {key} is not a LoRA factor (a trained module or bias?), "
                                    "which llmpipe does not serve")
    return match["module"], match["which"]


def _scale(config: dict, module: str, rank: int) -> float:
    alpha = config["lora_alpha"]
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):  # PEFT's get_pattern_key: the first pattern ending the name
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
