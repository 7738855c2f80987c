"""Qwen3-Next (Qwen3-Next-80B-A3B): Hugging Face directories of Qwen3NextForCausalLM (`qwen3_next`) and GGUF
`qwen3next`. Qwen3.5-MoE's model (the same Gated DeltaNet and gated attention layers, the same zero-centred norms)
but for its checkpoints: fused linear-layer projections, regrouped at load into Qwen3.5's (weights.py); dense layers
where mlp_only_layers / decoder_sparse_step say so; top-k weights renormalized as norm_topk_prob says; value heads
of a GGUF in Hugging Face's order (llama.cpp's converter tiles them for qwen35 / qwen35moe only)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from llmpipe.config import ModelConfig
from llmpipe.loader.gguf_names import GGUFArchitecture
from llmpipe.models.qwen3_5 import LINEAR, VALUES
from llmpipe.models.qwen3_5.config import qwen35_gguf_fields
from llmpipe.models.qwen3_5_moe import MOE_TENSORS, Qwen35MoeFamily
from llmpipe.models.qwen3_5_moe.config import qwen3_next_hf_fields
from llmpipe.models.qwen3_moe import EXPERT_TENSORS
from llmpipe.models.qwen3_moe.config import Qwen3MoeFields
from llmpipe.models.qwen3_next.weights import SplitProjectionWeights

if TYPE_CHECKING:
    from llmpipe.loader.checkpoint import WeightSource

TENSORS = {
    **MOE_TENSORS,
    "blk.{i}.ssm_in.weight": LINEAR + "in_proj_qkvz.weight",  # files converted before llama.cpp split it
    "blk.{i}.ssm_ba.weight": LINEAR + "in_proj_ba.weight",
}


class Qwen3NextFamily(Qwen35MoeFamily):
    name = "qwen3_next"
    model_types = ("qwen3_next",)
    gguf = {"qwen3next": GGUFArchitecture(tensors=TENSORS, experts=EXPERT_TENSORS, values=VALUES, partial_rotary=True)}
    hf_architectures = {"qwen3_next": "Qwen3NextForCausalLM"}

    def hf_moe_fields(self, cfg: dict[str, Any], path: Path) -> Qwen3MoeFields:
        return qwen3_next_hf_fields(cfg, path)

    def gguf_linear_fields(self, hp: Callable[..., Any]) -> dict[str, Any]:
        return qwen35_gguf_fields(hp, v_heads_tiled=False)

    def adapt_weights(self, source: WeightSource, config: ModelConfig) -> WeightSource:
        return SplitProjectionWeights(source, config.extra)

    def hf_config_fields(self, config: ModelConfig) -> dict[str, Any]:
        moe = config.extra.moe
        return {**super().hf_config_fields(config), "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, sparse in enumerate(moe.sparse_layers) if not sparse]}


QWEN3_NEXT = Qwen3NextFamily()
