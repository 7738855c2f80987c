"""Phi-3 / Phi-3.5 (model_type "phi3"): fused qkv and gate_up tensors, default RoPE or LongRoPE ("su")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.config import EngineConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.models.family import ModelFamily
from llmpipe.models.phi3.config import phi3_hf_fields
from llmpipe.models.phi3.model import Phi3ForCausalLM


class Phi3Family(ModelFamily):
    name = "phi3"
    model_class = Phi3ForCausalLM
    model_types = ("phi3",)
    # stacked stays empty: the checkpoint's fused tensors are the model's parameters, whole.

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        return cfg, phi3_hf_fields(cfg, path)

    def check_engine_options(self, config: EngineConfig) -> None:
        # Tensor parallelism slices checkpoint tensors by their q/k/v and gate/up names; fused ones it would not cut.
        if config.tensor_parallel_size > 1:
            raise UnsupportedModelError("phi3: tensor_parallel_size > 1 is not supported (fused qkv/gate_up tensors)")


PHI3 = Phi3Family()
