"""`llmpipe bench structured` on a tiny checkpoint: both kinds generate the same number of tokens
(the schema cannot end before output_len), and the ratio is the one the runs give."""

import argparse
import json

from llmpipe.bench import structured


def test_structured_bench_compares_equal_work(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "structured.json"
    args = argparse.Namespace(model=str(tiny_checkpoint("llama_gqa")), dtype="float32", batch_size=3, input_len=8,
                              output_len=12, repeats=2, output=str(out))
    structured.main(args)
    report = json.loads(out.read_text())
    for kind in ("plain", "json_schema"):
        assert [r["output_tokens"] for r in report["runs"][kind]] == [3 * 12] * 2
        assert all(r["finish_reasons"] == ["length"] for r in report["runs"][kind])
    best = report["best_output_tokens_per_s"]
    assert report["ratio"] == best["json_schema"] / best["plain"]
    assert "json_schema / plain" in capsys.readouterr().out
