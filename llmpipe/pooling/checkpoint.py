"""Reading an encoder's weights: model.safetensors only (pickled pytorch_model.bin is refused, never
unpickled), every floating tensor made float32, and copied by name into a module whose parameter
names are the checkpoint's, with one clear error for a missing, misplaced or misshapen tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from llmpipe.errors import ModelLoadError, UnsupportedModelError

WEIGHTS_FILE = "model.safetensors"
PICKLED_FILE = "pytorch_model.bin"


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        if (directory / PICKLED_FILE).is_file():
            raise UnsupportedModelError(f"{directory}: only {PICKLED_FILE}, a pickle llmpipe never loads; "
                                        f"convert it to {WEIGHTS_FILE}")
        raise ModelLoadError(f"{directory}: no {WEIGHTS_FILE}")
    try:
        tensors = load_file(file)
    except (OSError, SafetensorError) as error:
        raise ModelLoadError(f"cannot read {file}: {error}") from error
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}


def load_tensors(module: nn.Module, tensors: dict[str, torch.Tensor], source: Path,
                 rename: Callable[[str], str | None] = lambda name: name) -> None:
    """rename: checkpoint name → the module's name for it, or None for a tensor the module does not use."""
    expected = module.state_dict()
    state = {}
    for name, tensor in tensors.items():
        target = rename(name)
        if target is None:
            continue
        if target not in expected:
            raise ModelLoadError(f"{source}: checkpoint tensor {name!r} has no place in the model")
        if tensor.shape != expected[target].shape:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(expected[target].shape)}")
        state[target] = tensor
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{source}: checkpoint is missing {len(missing)} tensor(s), e.g. {missing[0]!r}")
    module.load_state_dict(state)
