"""Phi-3 / Phi-3.5 (model_type "phi3"): fused qkv and gate_up tensors, default RoPE or LongRoPE ("su")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.models.family import ModelFamily
from llmpipe.models.phi3.config import phi3_hf_fields
from llmpipe.models.phi3.model import Phi3ForCausalLM


class Phi3Family(ModelFamily):
    name = "phi3"
    model_class = Phi3ForCausalLM
    model_types = ("phi3",)
    # stacked stays empty: the checkpoint's fused tensors are the model's parameters, whole.
    # Tensor parallelism slices checkpoint tensors by their q/k/v and gate/up names; fused ones it would not cut.
    unsharded = "fused qkv/gate_up tensors"

    def hf_fields(self, cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        return cfg, phi3_hf_fields(cfg, path)


PHI3 = Phi3Family()
