"""What a model family tells the shared code: one `ModelFamily` per folder under models/, listed in registry.py.

The loaders parse the fields every architecture has (loader/hf_config.py, loader/gguf_config.py) and ask the
family for its own; the checkpoint's tensor list and the linear weights quantization converts come from the
family's model built on the meta device, so a family never lists its weights by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

import torch
from torch import nn

from llmpipe.config import EngineConfig, ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.kv_cache.paged import PagedKVCache
from llmpipe.layers.linear import Linear
from llmpipe.loader.hf_weights import SafetensorsWeights
from llmpipe.loader.quantized_weights import QuantizedSafetensorsWeights
from llmpipe.models.weights import EMBED, Stacking, shards

if TYPE_CHECKING:
    from llmpipe.loader.checkpoint import WeightSource
    from llmpipe.loader.gguf_names import GGUFArchitecture
    from llmpipe.loader.quant_config import QuantizationConfig

Shape = tuple[int, ...]


class ModelFamily:
    name: ClassVar[str]
    model_class: ClassVar[type[nn.Module]]  # built from a ModelConfig; loads checkpoint-named tensors
    model_types: ClassVar[tuple[str, ...]] = ()  # Hugging Face config.json `model_type`s it reads
    gguf: ClassVar[dict[str, GGUFArchitecture]] = {}  # GGUF `general.architecture` → its tensor-name table
    stacked: ClassVar[Stacking] = ()  # parameters that stack several checkpoint tensors by rows (q/k/v → qkv_proj)
    # model_type → config.json's "architectures" entry, for those whose config.json llmpipe writes (`llmpipe quantize`)
    hf_architectures: ClassVar[dict[str, str]] = {}
    # Why tensor_parallel_size > 1 is refused (None: the family's layers shard); check_engine_options says so.
    unsharded: ClassVar[str | None] = None

    @property
    def architectures(self) -> tuple[str, ...]:
        """Every ModelConfig.architecture of the family: its Hugging Face model types and GGUF architectures."""
        return tuple(dict.fromkeys((*self.model_types, *self.gguf)))

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """(config.json with the family's own names and defaults rewritten to the common ones that
        loader/hf_config.py reads, the ModelConfig fields the family sets itself, overriding those)."""
        return cfg, {}

    def gguf_fields(self, hp: Callable[..., Any]) -> dict[str, Any]:
        """ModelConfig fields from the family's GGUF metadata; hp(key, *default) reads `{architecture}.{key}`."""
        return {}

    def hf_weights(self, directory: Path, quant: QuantizationConfig | None) -> WeightSource:
        """A Hugging Face directory's tensors under the names the model loads (`quant`: its quantization_config)."""
        if quant is None:
            return SafetensorsWeights(directory)
        if quant.method not in ("gptq", "awq"):
            raise UnsupportedModelError(f"{directory}: {quant.method} checkpoints of {self.name} models are not supported")
        return QuantizedSafetensorsWeights(directory, quant)

    def adapt_weights(self, source: WeightSource, config: ModelConfig) -> WeightSource:
        """A checkpoint's tensors (Hugging Face directory or GGUF) under the names and row layout the model loads,
        where the family's checkpoints differ from it in ways only the config tells (Qwen3-Next's fused projections)."""
        return source

    def hf_config_fields(self, config: ModelConfig) -> dict[str, Any]:
        """The family's own entries of the config.json that hf_config_dict writes."""
        return {}

    def routing(self, config: ModelConfig) -> tuple[int, int] | None:
        """A mixture of experts' (experts per layer, experts a token reads), or None for a dense model."""
        return None

    @property
    def kv_cache_class(self) -> type:
        """The KV cache class for the family's layers (kv_cache/paged.py's KVCache protocol)."""
        return PagedKVCache

    def check_engine_options(self, config: EngineConfig) -> None:
        """Raise UnsupportedModelError (one line) for an engine option the family cannot run with."""
        if self.unsharded is not None and config.tensor_parallel_size > 1:
            raise UnsupportedModelError(f"{self.name}: tensor_parallel_size > 1 is not supported ({self.unsharded})")

    def checkpoint_tensors(self, model: nn.Module, param: str, shape: Shape) -> dict[str, Shape]:
        """The checkpoint tensors (name → shape) that fill one parameter of the model: itself, or the
        row slices of a stacked one."""
        module_name, _, kind = param.rpartition(".")
        module = model.get_submodule(module_name)
        return {f"{prefix}.{kind}": (len(range(shape[0])[rows]), *shape[1:])
                for prefix, rows in shards(module_name, module, self.stacked)}

    def weight_shapes(self, config: ModelConfig) -> dict[str, Shape]:
        """Every checkpoint tensor a model of `config` loads, with its shape, in model order."""
        return {name: shape for _, tensors in self._parameters(config) for name, shape in tensors.items()}

    def linear_weights(self, config: ModelConfig) -> list[str]:
        """Checkpoint names of the weights quantization converts: those filling a Linear layer's weight, and
        the embedding (quantized only as a tied head's matrix)."""
        return [name for (param, module), tensors in self._parameters(config)
                if (isinstance(module, Linear) and param.endswith(".weight")) or param == EMBED for name in tensors]

    def _parameters(self, config: ModelConfig) -> Iterator[tuple[tuple[str, nn.Module], dict[str, Shape]]]:
        with torch.device("meta"):
            model = self.model_class(config)
        for param, tensor in model.named_parameters():
            module = model.get_submodule(param.rpartition(".")[0])
            yield (param, module), self.checkpoint_tensors(model, param, tuple(tensor.shape))
