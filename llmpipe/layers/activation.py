"""The MLP activations a checkpoint's `hidden_act` names, with transformers' meanings."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from llmpipe.errors import UnsupportedModelError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # the same tanh approximation
    "relu": F.relu,
}


def check_activation(name: str, where: object) -> str:
    """`name` if llmpipe computes it; otherwise one clear error (never a silently different model)."""
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"{where}: hidden_act {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    return name
