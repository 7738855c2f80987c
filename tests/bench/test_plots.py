"""`--plot` figures: written as PNGs, and the Figure objects hold the expected axes and data."""

import json
from functools import partial

import pytest

from llmpipe.bench import plots
from llmpipe.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def labels(fig) -> list[tuple[str, str]]:
    return [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes]


def test_roofline_places_points_at_their_intensity_and_rate(tmp_path):
    points = [plots.RooflinePoint("decode", flops=2e8, bytes=5e8, seconds=0.05),
              plots.RooflinePoint("prefill", flops=1e11, bytes=5e8, seconds=1.0)]
    fig = plots.figure([partial(plots.draw_roofline, bandwidth=20e9, peak_flops=400e9, points=points)])
    (ax,) = fig.axes
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert labels(fig) == [("arithmetic intensity (FLOP/byte)", "FLOP/s")]
    roof = ax.lines[0].get_ydata()
    assert max(roof) == 400e9 and min(roof) < 400e9  # flat compute roof, sloped bandwidth roof
    placed = [tuple(c.get_offsets()[0]) for c in ax.collections]
    assert placed == [pytest.approx((0.4, 4e9)), pytest.approx((200.0, 1e11))]
    assert_png(plots.save(fig, tmp_path / "roof.png"))


def test_distribution_and_throughput_panels_hold_the_data():
    fig = plots.figure([
        partial(plots.draw_distribution, samples={"a": [0.01] * 8 + [0.02] * 4}, xlabel="ITL (ms)", title="t"),
        partial(plots.draw_throughput, series={"llmpipe": ([1, 64], [12.0, 75.0])}),
    ])
    hist, tput = fig.axes
    assert sum(p.get_height() for p in hist.patches) == 12  # every sample counted once
    assert max(p.get_x() + p.get_width() for p in hist.patches) == pytest.approx(20.0)  # drawn in ms
    x, y = tput.lines[0].get_data()
    assert list(x) == [1, 64] and list(y) == [12.0, 75.0]
    assert labels(fig)[1] == ("batch size (concurrent sequences)", "output tokens/s")


def test_bench_latency_plot(tiny_checkpoint, tmp_path, capsys):
    model, out, png = str(tiny_checkpoint("llama_gqa")), tmp_path / "latency.json", tmp_path / "latency.png"
    assert main(["bench", "latency", "--model", model, "--prompt-len", "32", "--output-lens", "4", "8",
                 "--variants", "float32", "--no-baseline", "--output", str(out), "--plot", str(png)]) == 0
    assert_png(png)
    report = json.loads(out.read_text())
    fig = plots.latency_figure(report)
    ttft, itl, roof = fig.axes
    assert labels(fig) == [("TTFT, 32-token prompt (ms)", "count"), ("inter-token latency (ms)", "count"),
                           ("arithmetic intensity (FLOP/byte)", "FLOP/s")]
    assert sum(p.get_height() for p in ttft.patches) == 3  # three TTFT trials
    assert sum(p.get_height() for p in itl.patches) == 7  # 8 tokens, 7 gaps
    assert [c.get_label() for c in roof.collections][0].startswith("float32 prefill")
    prefill, decode = (c.get_offsets()[0][0] for c in roof.collections)
    assert prefill > 10 * decode  # a prompt reuses every weight it reads; one decoded token does not


def test_bench_throughput_plot(tiny_checkpoint, tmp_path):
    model, out, png = str(tiny_checkpoint("llama_gqa")), tmp_path / "tput.json", tmp_path / "tput.png"
    assert main(["bench", "throughput", "--model", model, "--num-prompts", "4", "--input-len", "16", "--output-len",
                 "6", "--sequential-prompts", "1", "--no-baseline", "--output", str(out), "--plot", str(png)]) == 0
    assert_png(png)
    report = json.loads(out.read_text())
    fig = plots.throughput_figure(report)
    assert len(fig.axes) == 4
    x, y = fig.axes[2].lines[0].get_data()
    assert list(x) == [1, 4]
    assert list(y) == [report["one_at_a_time"]["output_tokens_per_s"], report["batched"]["output_tokens_per_s"]]
    assert sum(p.get_height() for p in fig.axes[1].patches) == 4 * 5  # 4 requests × 5 gaps


def test_diagnose_plot(tiny_checkpoint, tmp_path):
    png = tmp_path / "diagnose.png"
    assert main(["diagnose", "--model", str(tiny_checkpoint("llama_gqa")), "--prompt-len", "16", "--output-len",
                 "8", "--kv-cache-memory", "64MiB", "--output", str(tmp_path / "d.json"), "--plot", str(png)]) == 0
    assert_png(png)
