"""Benchmark figures, drawn off-screen (matplotlib's Figure, no pyplot state): TTFT and ITL
distributions, throughput vs batch size, time split, and the roofline that places a run's prefill
and decode against this machine's measured bandwidth and compute limits.

Each draw_* function fills one Axes; `figure` lays out the panels a command has data for, and
`save` writes the PNG. The latency and throughput adapters turn those benchmarks' reports into panels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from llmpipe.config import ModelConfig
from llmpipe.diagnose import costs

Panel = Callable[[Axes], None]


@dataclass
class RooflinePoint:
    label: str
    flops: float
    bytes: float
    seconds: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def rate(self) -> float:
        return self.flops / self.seconds


def draw_distribution(ax: Axes, samples: dict[str, list[float]], xlabel: str, title: str) -> None:
    """Histogram per label of durations given in seconds, drawn in milliseconds."""
    for label, values in samples.items():
        if values:
            ax.hist([v * 1e3 for v in values], bins=min(30, max(5, len(values) // 4)), alpha=0.6, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    ax.set_title(title)
    ax.legend(fontsize="small")


def draw_lines(ax: Axes, series: dict[str, tuple[list[float], list[float]]], xlabel: str, ylabel: str,
               title: str, styles: dict[str, str] | None = None) -> None:
    """One line per label over a log2 x axis (`styles`: a matplotlib format string per label)."""
    for label, (x, y) in series.items():
        ax.plot(x, y, (styles or {}).get(label, "o-"), label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")


def draw_throughput(ax: Axes, series: dict[str, tuple[list[float], list[float]]],
                    xlabel: str = "batch size (concurrent sequences)") -> None:
    draw_lines(ax, series, xlabel, "output tokens/s", "throughput vs batch size")


def draw_time_split(ax: Axes, seconds: dict[str, float]) -> None:
    """One horizontal bar per phase (queue, prefill, decode, overhead), labelled with its share."""
    total = sum(seconds.values()) or 1.0
    names = list(seconds)
    bars = ax.barh(names, [seconds[n] for n in names])
    ax.bar_label(bars, labels=[f"{seconds[n] / total:.0%}" for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per request")
    ax.set_title("where the time went")


def draw_roofline(ax: Axes, bandwidth: float, peak_flops: float, points: list[RooflinePoint]) -> None:
    """Attainable FLOP/s = min(peak FLOP/s, intensity × bandwidth), log-log, with the run's phases on it."""
    ridge = peak_flops / bandwidth
    lo = min([ridge / 100] + [p.intensity / 4 for p in points])
    hi = max([ridge * 100] + [p.intensity * 4 for p in points])
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(peak_flops, x * bandwidth) for x in xs], color="black",
            label=f"roof: {bandwidth / 1e9:.1f} GB/s, {peak_flops / 1e9:.0f} GFLOP/s")
    for p in points:
        ax.scatter([p.intensity], [p.rate], zorder=3, label=f"{p.label}: {p.rate / 1e9:.1f} GFLOP/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title("roofline")
    ax.legend(fontsize="small")


def figure(panels: list[Panel], title: str | None = None) -> Figure:
    fig = Figure(figsize=(5.5 * len(panels), 4.5), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, draw in zip(axes, panels):
        draw(ax)
    if title:
        fig.suptitle(title)
    return fig


def save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


# ---- benchmark reports → figures -------------------------------------------------------------


def prefill_point(label: str, cfg: ModelConfig, weight_bytes: int, kv_bytes_per_token: int, prompt_len: int,
                  seconds: float, prompts: int = 1, chunk_tokens: int = 2048) -> RooflinePoint:
    tokens = prompts * prompt_len
    return RooflinePoint(label, prompts * costs.prefill_flops(cfg, prompt_len),
                         costs.prefill_bytes(weight_bytes, kv_bytes_per_token, tokens, chunk_tokens), seconds)


def decode_point(label: str, cfg: ModelConfig, weight_bytes: int, kv_bytes_per_token: int, prompt_len: int,
                 output_len: int, step_seconds: float, batch: int = 1) -> RooflinePoint:
    context = costs.mean_decode_context(prompt_len, output_len)
    return RooflinePoint(label, batch * costs.decode_flops(cfg, context),
                         costs.decode_step_bytes(cfg, weight_bytes, kv_bytes_per_token, batch, context), step_seconds)


def latency_figure(report: dict) -> Figure:
    """`bench latency`: TTFT and ITL of each variant, and each variant's prefill and decode on the roofline."""
    cfg = ModelConfig(**report["model_config"])
    measured = [r for r in report["results"] if "itl_samples_s" in r]
    n = max(report["output_lens"])
    points = []
    for r in measured:
        w, kv = r["weight_bytes"], r["kv_bytes_per_token"]
        points.append(prefill_point(f"{r['variant']} prefill", cfg, w, kv, report["prompt_len"], r["ttft_s"]))
        points.append(decode_point(f"{r['variant']} decode", cfg, w, kv, report["decode_prompt_len"], n,
                                   1 / r[f"decode_{n}"]))
    return figure([
        partial(draw_distribution, samples={r["variant"]: r["ttft_samples_s"] for r in measured},
                xlabel=f"TTFT, {report['prompt_len']}-token prompt (ms)", title="time to first token"),
        partial(draw_distribution, samples={r["variant"]: r["itl_samples_s"] for r in measured},
                xlabel="inter-token latency (ms)", title=f"ITL over {n} tokens, batch 1"),
        partial(draw_roofline, bandwidth=report["memory_bandwidth_GBps"] * 1e9,
                peak_flops=report["matmul_GFLOPs"] * 1e9, points=points),
    ], title=f"llmpipe bench latency: {report['model']}")


def throughput_figure(report: dict) -> Figure:
    """`bench throughput`: TTFT and ITL of the batched run, tokens/s at batch 1 and batched, roofline."""
    cfg = ModelConfig(**report["model_config"])
    b, samples, batch = report["batched"], report["samples"], report["peak_batch"]
    series = {"llmpipe": ([1, batch], [report["one_at_a_time"]["output_tokens_per_s"], b["output_tokens_per_s"]])}
    if "transformers_batched" in report:
        hf = report["transformers_batched"]["output_tokens_per_s"]
        series["transformers generate"] = ([report["num_prompts"]], [hf])
    w, kv = report["weight_bytes"], b["kv_bytes_per_token"]
    points = [
        prefill_point(f"prefill ×{report['num_prompts']}", cfg, w, kv, report["input_len"], samples["prefill_wall_s"],
                      prompts=report["num_prompts"], chunk_tokens=report["max_num_batched_tokens"]),
        decode_point(f"decode, batch {batch}", cfg, w, kv, report["input_len"], report["output_len"],
                     samples["mean_itl_s"], batch=batch),
    ]
    return figure([
        partial(draw_distribution, samples={"llmpipe batched": samples["ttft_samples_s"]},
                xlabel="TTFT (ms)", title=f"time to first token, {report['num_prompts']} requests"),
        partial(draw_distribution, samples={"llmpipe batched": samples["itl_samples_s"]},
                xlabel="inter-token latency (ms)", title="ITL, batched run"),
        partial(draw_throughput, series=series),
        partial(draw_roofline, bandwidth=report["memory_bandwidth_GBps"] * 1e9,
                peak_flops=report["matmul_GFLOPs"] * 1e9, points=points),
    ], title=f"llmpipe bench throughput: {report['model']}")
