"""`llmpipe bench breakdown` on a tiny checkpoint: both paths measured, parts that add up to the step."""

import argparse
import json

from llmpipe.bench import breakdown


def test_breakdown_reports_both_paths(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "breakdown.json"
    args = argparse.Namespace(model=str(tiny_checkpoint("llama_gqa")), variants=["float32"], group_size=128,
                              tokens=4, repeats=1, output=str(out))
    breakdown.main(args)
    report = json.loads(out.read_text())
    paths = report["variants"]["float32"]
    assert set(paths) == set(breakdown.PATHS)
    for r in paths.values():
        assert r["layers_ms"] > 0 and r["lm_head_ms"] > 0
        assert abs(r["layers_ms"] + r["lm_head_ms"] + r["rest_ms"] - r["step_ms"]) < 1e-6
    table = capsys.readouterr().out
    assert "fused decode step" in table and "layer by layer" in table
