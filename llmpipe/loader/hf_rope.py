"""RoPE settings from a config.json, in either spelling transformers writes."""

from __future__ import annotations

from typing import Any


def hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either spelling: transformers 5 writes `rope_parameters`
    ({"rope_theta", "rope_type", …}); older files have top-level rope_theta and `rope_scaling`
    (whose type key may be the legacy "type")."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **params}
