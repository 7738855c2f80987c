"""DeepSeek V4's config.json, read as transformers' `DeepseekV4Config` reads it.

Both spellings load: the one `save_pretrained` writes (layer_types, compress_rates, mlp_layer_types,
partial_rotary_factor, rope_parameters nested as {"main", "compress"}) and the published checkpoints'
(compress_ratios, num_hash_layers, qk_rope_head_dim, moe_intermediate_size, n_routed_experts, a flat
rope_scaling that applies to the compressed layers only). Missing keys take DeepseekV4Config's defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.config import CSA, HCA, DeepseekV4Fields
from llmpipe.diagnose.compressed_kv import layer_schedule
from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.models.deepseek_v4.moe import SCORE_FUNCTIONS

V4_DEFAULTS: dict[str, Any] = {
    "moe_intermediate_size": 2048, "num_key_value_heads": 1, "head_dim": 512, "sliding_window": 128,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "bos_token_id": 0, "eos_token_id": 1,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0, "hidden_act": "silu",
}
NUM_HASH_LAYERS = 3  # default: the first three layers route by token id
ROPE_FRACTION = 64 / 512  # default partial_rotary_factor
# Dropped from the compressed layers' rope dict: transformers nests it under "compress", where its YaRN
# code never looks for it (it reads `truncate` from the top level), so truncation is always on.
_NOT_SCALING = ("rope_theta", "partial_rotary_factor", "type", "truncate")


def deepseek_v4_config(cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], DeepseekV4Fields]:
    """(config.json with the defaults and the generic names hf_model_config reads filled in, V4's own fields)."""
    cfg = {**V4_DEFAULTS, **cfg}
    _check(cfg, path)
    (main_theta, compress_theta), compress_scaling = _ropes(cfg, path)
    generic = {
        **cfg,
        "intermediate_size": cfg["moe_intermediate_size"],
        "num_key_value_heads": 1,  # one K=V head shared by every query head
        "rope_parameters": {"rope_type": "default", "rope_theta": main_theta},
        "rope_scaling": None,
    }
    return generic, _fields(cfg, compress_theta, compress_scaling, path)


def _check(cfg: dict[str, Any], path: Path) -> None:
    if cfg["hidden_act"] != "silu":
        raise UnsupportedModelError(f"{path}: DeepSeek V4 hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    if cfg["scoring_func"] not in SCORE_FUNCTIONS:
        raise UnsupportedModelError(
            f"{path}: DeepSeek V4 scoring_func {cfg['scoring_func']!r} is not supported ({', '.join(SCORE_FUNCTIONS)})"
        )
    if cfg["n_shared_experts"] != 1:
        raise UnsupportedModelError(f"{path}: DeepSeek V4 n_shared_experts={cfg['n_shared_experts']} is not supported (1)")


def _ropes(cfg: dict[str, Any], path: Path) -> tuple[tuple[float, float], dict[str, Any] | None]:
    """((main θ, compressed θ), the compressed layers' scaling): DeepseekV4Config.__post_init__'s nesting."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], dict(params["compress"])
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise UnsupportedModelError(f"{path}: DeepSeek V4 main RoPE must be unscaled, got {main}")
        thetas = float(main["rope_theta"]), float(compress["rope_theta"])
    else:  # one flat dict (or legacy rope_scaling): it scales the compressed layers only
        compress = {**(cfg.get("rope_scaling") or {}), **params}
        compress["rope_type"] = compress.get("rope_type") or compress.get("type") or "default"
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
        thetas = float(cfg["rope_theta"]), float(cfg["compress_rope_theta"])
    scaling = {k: v for k, v in compress.items() if k not in _NOT_SCALING}
    return thetas, None if scaling["rope_type"] == "default" else scaling


def _fields(cfg: dict[str, Any], compress_theta: float, compress_scaling: dict | None, path: Path) -> DeepseekV4Fields:
    layers = int(cfg["num_hidden_layers"])
    if not cfg.get("layer_types") and "compress_ratios" not in cfg:  # transformers' default schedule
        cfg = {**cfg, "layer_types": [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(layers - 2)]}
    layer_types, rates = layer_schedule(cfg)
    return DeepseekV4Fields(
        layer_types=tuple(layer_types),
        compress_rates=rates,
        q_lora_rank=int(cfg["q_lora_rank"]),
        o_groups=int(cfg["o_groups"]),
        o_lora_rank=int(cfg["o_lora_rank"]),
        rope_head_dim=_rope_head_dim(cfg),
        compress_rope_theta=compress_theta,
        compress_rope_scaling=compress_scaling,
        index_n_heads=int(cfg["index_n_heads"]),
        index_head_dim=int(cfg["index_head_dim"]),
        index_topk=int(cfg["index_topk"]),
        hc_mult=int(cfg["hc_mult"]),
        hc_sinkhorn_iters=int(cfg["hc_sinkhorn_iters"]),
        hc_eps=float(cfg["hc_eps"]),
        mlp_layer_types=_mlp_layer_types(cfg, layers, path),
        num_experts=int(cfg["n_routed_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
        scoring_func=cfg["scoring_func"],
        swiglu_limit=float(cfg["swiglu_limit"]),
    )


def _mlp_layer_types(cfg: dict[str, Any], layers: int, path: Path) -> tuple[str, ...]:
    """Explicit mlp_layer_types, else the first num_hash_layers "hash_moe" and "moe" after them."""
    hashed = cfg.get("num_hash_layers")
    hashed = NUM_HASH_LAYERS if hashed is None else hashed
    types = tuple((cfg.get("mlp_layer_types") or ["hash_moe"] * hashed + ["moe"] * layers)[:layers])
    if len(types) != layers or set(types) - {"hash_moe", "moe"}:
        raise ModelLoadError(f"{path}: DeepSeek V4 mlp_layer_types {list(types)} for {layers} layers")
    return types


def _rope_head_dim(cfg: dict[str, Any]) -> int:
    """head_dim × partial_rotary_factor, that factor defaulting to qk_rope_head_dim / head_dim (as transformers)."""
    head_dim, fraction = int(cfg["head_dim"]), cfg.get("partial_rotary_factor")
    if fraction is None:
        fraction = cfg["qk_rope_head_dim"] / head_dim if cfg.get("qk_rope_head_dim") is not None else ROPE_FRACTION
    return int(head_dim * fraction)
