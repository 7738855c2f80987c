"""The model families llmpipe serves, one line each, and finding the one a checkpoint needs."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.gguf_names import GGUFArchitecture
from llmpipe.models.deepseek_v4 import DEEPSEEK_V4
from llmpipe.models.family import ModelFamily
from llmpipe.models.gemma3 import GEMMA3
from llmpipe.models.gpt_oss import GPT_OSS
from llmpipe.models.llama import LLAMA
from llmpipe.models.phi3 import PHI3
from llmpipe.models.qwen3_5 import QWEN3_5
from llmpipe.models.qwen3_5_moe import QWEN3_5_MOE
from llmpipe.models.qwen3_moe import QWEN3_MOE
from llmpipe.models.qwen3_next import QWEN3_NEXT

FAMILIES: tuple[ModelFamily, ...] = (
    LLAMA,
    GEMMA3,
    DEEPSEEK_V4,
    PHI3,
    QWEN3_MOE,
    GPT_OSS,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_NEXT,
)

T = TypeVar("T")


def family_of(architecture: str) -> ModelFamily:
    """The family of a ModelConfig.architecture (a Hugging Face model type or a GGUF architecture)."""
    return _find({a: f for f in FAMILIES for a in f.architectures}, "architecture", architecture)


def hf_family(model_type: str | None, path: Path) -> ModelFamily:
    return _find({t: f for f in FAMILIES for t in f.model_types}, "model_type", model_type, path)


def gguf_architecture(name: str, path: Path) -> GGUFArchitecture:
    return _find({a: table for f in FAMILIES for a, table in f.gguf.items()}, "GGUF architecture", name, path)


def _find(known: dict[str, T], what: str, name: str | None, path: Path | None = None) -> T:
    if name not in known:
        where = f"{path}: " if path else ""
        raise UnsupportedModelError(f"{where}{what} {name!r} is not supported (supported: {', '.join(known)})")
    return known[name]
