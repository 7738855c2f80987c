"""Quantized tiny checkpoints, written once per session by `quantize_model`."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmpipe.quant.quantize import quantize_model

GROUP = 32
CALIBRATION = dict(num_samples=4, seq_len=64)


@pytest.fixture(scope="session")
def quantized_dir(tiny_checkpoint, tmp_path_factory):
    """Factory: (tiny config name, method, act_order) → directory written by `llmpipe quantize`."""
    cache: dict[tuple, Path] = {}

    def make(name: str, method: str, act_order: bool = False) -> Path:
        key = (name, method, act_order)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{name}_{method}{'_act' if act_order else ''}")
            cache[key] = quantize_model(
                str(tiny_checkpoint(name)), method, out, group_size=GROUP, act_order=act_order, progress=False, **CALIBRATION
            )
        return cache[key]

    return make
