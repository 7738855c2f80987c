"""DeepSeek V4's config.json, read as transformers' `DeepseekV4Config` reads it.

Both spellings load: the one `save_pretrained` writes (layer_types, compress_rates, mlp_layer_types,
partial_rotary_factor, rope_parameters nested as {"main", "compress"}) and the published checkpoints'
(compress_ratios, num_hash_layers, qk_rope_head_dim, moe_intermediate_size, n_routed_experts, a flat
rope_scaling that applies to the compressed layers only). Missing keys take DeepseekV4Config's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.errors import ModelLoadError, UnsupportedModelError
from llmpipe.models.deepseek_v4.moe import SCORE_FUNCTIONS

# Layer types (transformers' names): window only, compressed sparse, heavily compressed.
WINDOW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_TO_LAYER_TYPE = {0: WINDOW, 4: CSA, 128: HCA}  # `compress_ratios` entries, as transformers reads them
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class DeepseekV4Fields:
    """DeepSeek V4's own hyperparameters, named as in transformers' DeepseekV4Config."""

    # Per layer: "sliding_attention" (window only), "compressed_sparse_attention" (CSA),
    # "heavily_compressed_attention" (HCA); compress_rates maps the last two to their ratios.
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_head_dim: int  # RoPE on the last rope_head_dim dims of each head, interleaved pairs
    compress_rope_theta: float
    compress_rope_scaling: dict[str, Any] | None  # Hugging Face rope dict of the CSA/HCA layers (yarn)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]  # per layer: "hash_moe" / "moe"
    num_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float


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


def layer_schedule(cfg: dict) -> tuple[list[str], dict[str, int]]:
    """Each layer's type and each compressed type's ratio, as transformers' `DeepseekV4Config` derives them.
    Published checkpoints ship `compress_ratios` (one more than the layers: the MTP layer's, dropped); transformers
    saves `layer_types` and `compress_rates`."""
    n = config_int(cfg, "num_hidden_layers")
    rates = {**DEFAULT_COMPRESS_RATES, **(cfg.get("compress_rates") or {})}
    for layer_type, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        rates[layer_type] = cfg.get(legacy, rates[layer_type])
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"][:n])
    elif "compress_ratios" in cfg:
        unknown = set(cfg["compress_ratios"]) - set(RATIO_TO_LAYER_TYPE)
        if unknown:
            raise ModelLoadError(f"DeepSeek V4 compress_ratios: {sorted(unknown)} not among 0, 4, 128")
        types = [RATIO_TO_LAYER_TYPE[r] for r in cfg["compress_ratios"][:n]]
    else:
        raise ModelLoadError("DeepSeek V4 config has neither compress_ratios nor layer_types")
    if len(types) != n or set(types) - {WINDOW, CSA, HCA}:
        raise ModelLoadError(f"DeepSeek V4 config: layer types {sorted(set(types))} for {n} layers")
    return types, rates


def config_int(cfg: dict, name: str) -> int:
    if not isinstance(cfg.get(name), int):
        raise ModelLoadError(f"{cfg.get('model_type')} config lacks an integer {name}")
    return cfg[name]


def _rope_head_dim(cfg: dict[str, Any]) -> int:
    """head_dim × partial_rotary_factor, that factor defaulting to qk_rope_head_dim / head_dim (as transformers)."""
    head_dim, fraction = int(cfg["head_dim"]), cfg.get("partial_rotary_factor")
    if fraction is None:
        fraction = cfg["qk_rope_head_dim"] / head_dim if cfg.get("qk_rope_head_dim") is not None else ROPE_FRACTION
    return int(head_dim * fraction)
