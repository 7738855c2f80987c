"""Reading the small JSON files that ship beside model weights, with one clear error for bad ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmpipe.errors import ModelLoadError


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value
