"""A multimodal Qwen3.5 checkpoint (Qwen3_5ForConditionalGeneration) read as its text model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmpipe.loader.checkpoint import WeightSource

LANGUAGE_MODEL = "model.language_model."  # beside it: model.visual.* and mtp.*, which the text model does not read


def text_weights(source: WeightSource) -> WeightSource:
    """`source` itself, or, where its text model's tensors sit under model.language_model., those under model.*."""
    stored = list(source.shapes())
    return LanguageModelWeights(source, stored) if any(name.startswith(LANGUAGE_MODEL) for name in stored) else source


class LanguageModelWeights:
    """A WeightSource renaming model.language_model.X to model.X (lm_head.weight keeps its name)."""

    def __init__(self, source: WeightSource, stored: list[str]) -> None:
        self.source, self.file_bytes = source, source.file_bytes
        self.stored = {_text_name(name): name for name in stored}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = self.source.shapes()
        return {name: shapes[stored] for name, stored in self.stored.items()}

    def check_readable(self, names: Iterable[str]) -> None:
        self.source.check_readable([self.stored[name] for name in names])

    def read(self, name: str) -> torch.Tensor:
        return self.source.read(self.stored[name])


def _text_name(name: str) -> str:
    return "model." + name.removeprefix(LANGUAGE_MODEL) if name.startswith(LANGUAGE_MODEL) else name
