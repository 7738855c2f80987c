"""Every weight a model loads, by checkpoint name, with its expected shape."""

from __future__ import annotations

from llmpipe.config import ModelConfig
from llmpipe.models import registry  # a module, not its names: the families import loader modules in turn


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """In model order; the family derives them from its model built on the meta device."""
    return registry.family_of(config.architecture).weight_shapes(config)
