"""Checkpoint: a model's config, tokenizer and lazily read weights, from a GGUF file or HF directory."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from tqdm import tqdm

from llmpipe.config import ModelConfig
from llmpipe.errors import ModelLoadError
from llmpipe.loader.aliases import resolve_model
from llmpipe.loader.gguf_config import gguf_model_config
from llmpipe.loader.gguf_file import drop_vocabulary, open_gguf
from llmpipe.loader.gguf_weights import GGUFWeights
from llmpipe.loader.hf_config import hf_model_config
from llmpipe.loader.quant_config import hf_quantization_config
from llmpipe.loader.weight_names import expected_weight_shapes
from llmpipe.models import registry  # a module, not its names: the families import loader modules in turn
from llmpipe.quant.apply import QuantPlan, quant_plan
from llmpipe.quant.formats import QuantizedWeight

if TYPE_CHECKING:
    from llmpipe.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
BODY_PREFIX, BODY_EMBEDDING = "model.", "embed_tokens.weight"


class WeightSource(Protocol):
    """Where a checkpoint's tensors live; names are Hugging Face names."""

    file_bytes: int

    def shapes(self) -> dict[str, tuple[int, ...]]: ...  # from metadata only

    def check_readable(self, names: Iterable[str]) -> None: ...  # UnsupportedModelError if not

    def read(self, name: str) -> torch.Tensor: ...


@dataclass
class Checkpoint:
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: Path  # resolved file or directory
    file_bytes: int  # size on disk of the weights
    source: WeightSource = field(repr=False, compare=False)

    def quant_plan(self, quantization: str | None, group_size: int) -> QuantPlan:
        """Weight formats for `quantization` (None, "auto", "int8", "int4"); see llmpipe.quant.apply."""
        native = getattr(self.source, "native_format", None)
        linear = registry.family_of(self.config.architecture).linear_weights(self.config)
        return quant_plan(linear, quantization, group_size, native)

    def iter_weights(
        self, progress: bool = False, plan: QuantPlan | None = None
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(Hugging Face name, tensor), read one at a time, in model order: float, or quantized as
        stored where `plan` asks for exactly the format the checkpoint holds (no float round trip).

        Float tensors of a GGUF may be views of its copy-on-write mapping (writes never reach the file).
        Once the consumer asks for the next tensor, the last one's mapped pages are let go (a GGUF's
        `release_pages`): a copied tensor's file pages are resident one at a time, not whole beside the
        model. GGML block tensors the model keeps as views of the mapping keep their pages.
        """
        names = list(expected_weight_shapes(self.config))
        native = getattr(self.source, "native_format", lambda name: None)
        release = getattr(self.source, "release_pages", lambda name: None)
        bar = tqdm(names, desc=f"Loading {self.path.name}", unit="tensor", disable=not progress, leave=False)
        for name in bar:
            fmt = (plan or {}).get(name)
            keep = fmt is not None and native(name) == fmt
            yield name, self.source.read_quantized(name) if keep else self.source.read(name)
            release(name)


def load_checkpoint(model: str) -> Checkpoint:
    """Read a checkpoint's config and tokenizer and check its tensor table; weights stay on disk."""
    path = resolve_model(model)
    with _collector_paused():
        config, source, tokenizer = _open_hf_dir(path) if path.is_dir() else _open_gguf(path)
    check_weights(source, config, path)
    logger.info(
        "%s: %s, %d layers, %.1f MiB of weights", path, config.architecture, config.num_hidden_layers,
        source.file_bytes / 2**20,
    )
    return Checkpoint(config=config, tokenizer=tokenizer, path=path, file_bytes=source.file_bytes, source=source)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while the vocabulary's strings are parsed: its passes over the
    hundreds of thousands of new objects cost ten times the parse (Llama 3's metadata: 0.32 s vs 0.03 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _open_hf_dir(directory: Path) -> tuple[ModelConfig, WeightSource, Tokenizer | None]:
    config = hf_model_config(directory)
    quant = hf_quantization_config(directory)  # GPTQ / AWQ: quantized linears read as Int4Weight; gpt-oss's MXFP4
    family = registry.family_of(config.architecture)
    source = family.adapt_weights(family.hf_weights(directory, quant), config)
    if is_body_only(source):
        source, config = BodyWeights(source), replace(config, tie_word_embeddings=True, embedding_only=True)
    if not any((directory / name).is_file() for name in HF_TOKENIZER_FILES):
        logger.warning("%s: no tokenizer files; loading without a tokenizer", directory)
        return config, source, None
    from llmpipe.tokenizer.hf_tokenizer import load_hf_tokenizer  # deferred: the tokenizer package imports much more

    return config, source, load_hf_tokenizer(directory)


def is_body_only(source: WeightSource) -> bool:
    """Saved by AutoModel rather than AutoModelForCausalLM: the body's tensors without the "model." prefix, and
    no LM head (as embedding models ship)."""
    names = source.shapes()
    return BODY_EMBEDDING in names and not any(name.startswith(BODY_PREFIX) for name in names)


class BodyWeights:
    """A body-only checkpoint's tensors under the causal LM's names; the embedding stands in for the absent
    head (tied), which an embedding-only model never uses."""

    def __init__(self, source: WeightSource) -> None:
        self.source, self.file_bytes = source, source.file_bytes

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {BODY_PREFIX + name: shape for name, shape in self.source.shapes().items()}

    def check_readable(self, names: Iterable[str]) -> None:
        self.source.check_readable([name.removeprefix(BODY_PREFIX) for name in names])

    def read(self, name: str) -> torch.Tensor:
        return self.source.read(name.removeprefix(BODY_PREFIX))


def _open_gguf(path: Path) -> tuple[ModelConfig, WeightSource, Tokenizer | None]:
    reader = open_gguf(path)
    config = gguf_model_config(reader, path)  # UnsupportedModelError for other architectures
    arch = registry.gguf_architecture(config.architecture, path)
    source = GGUFWeights(reader, path, arch, config)
    source = registry.family_of(config.architecture).adapt_weights(source, config)
    from llmpipe.tokenizer.gguf_tokenizer import load_gguf_tokenizer  # deferred, as load_hf_tokenizer

    tokenizer = load_gguf_tokenizer(reader) if reader.get_field("tokenizer.ggml.tokens") is not None else None
    drop_vocabulary(reader)
    return config, source, tokenizer


def check_weights(source: WeightSource, config: ModelConfig, path: Path) -> None:
    """Every weight the config implies is present, has the right shape, and can be read."""
    expected, present = expected_weight_shapes(config), source.shapes()
    missing = [name for name in expected if name not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{path}: checkpoint is missing tensor {missing[0]}{more}")
    for name, shape in expected.items():
        if present[name] != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {list(present[name])}, expected {list(shape)}")
    source.check_readable(expected)
    unused = len(present) - len(expected)
    if unused:
        logger.debug("%s: ignoring %d tensors the model does not use", path, unused)

