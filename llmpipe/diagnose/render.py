"""Text and figures for `llmpipe diagnose` and `llmpipe memory`."""

from __future__ import annotations

from functools import partial

from matplotlib.figure import Figure

from llmpipe.bench.plots import RooflinePoint, draw_roofline, draw_time_split, figure
from llmpipe.bench.report import format_table
from llmpipe.diagnose.compressed_kv import CompressedKVPlan
from llmpipe.diagnose.report import Diagnosis
from llmpipe.diagnose.memory import MemoryPlan


def fmt_bytes(n: float) -> str:
    """Decimal and binary units side by side: weights are usually quoted in GB, caches in GiB / MiB."""
    for power, dec, binary in ((3, "GB", "GiB"), (2, "MB", "MiB"), (1, "KB", "KiB")):
        if n >= 1000**power:
            return f"{n / 1000**power:.4g} {dec} ({n / 1024**power:.4g} {binary})"
    return f"{n:,.0f} B"


def format_diagnosis(d: Diagnosis, model: str) -> str:
    w, s = d.workload, d.split
    lines = [f"llmpipe diagnose: {model}, batch {w.batch}, prompt {w.prompt_len} tokens, "
             f"{w.output_len:g} output token{'' if w.output_len == 1 else 's'} per request", ""]
    frac = s.fractions()
    itl = f"ITL {s.mean_itl_s * 1e3:.1f} ms × {w.output_len - 1:g}" if s.mean_itl_s else "one token: no decode"
    rows = [["time per request", "seconds", "share"],
            ["queue", f"{s.queue_s:.3f}", f"{frac['queue']:.0%}"],
            [f"prefill (TTFT {s.ttft_s * 1e3:.0f} ms)", f"{s.prefill_s:.3f}", f"{frac['prefill']:.0%}"],
            [f"decode ({itl})", f"{s.decode_s:.3f}", f"{frac['decode']:.0%}"],
            ["detokenize / stream overhead", f"{s.overhead_s:.3f}", f"{frac['overhead']:.0%}"],
            ["total", f"{s.total_s:.3f}", "100%"]]
    lines.append(format_table(rows))
    lines += _rate_lines(d)
    lines += ["", f"verdict: {d.verdict}", "", "levers, by estimated gain:"]
    rows = [["#", "lever", "gain", "on", "how"]]
    rows += [[str(i), lv.name, f"{lv.gain:.2f}x", lv.metric, lv.action] for i, lv in enumerate(d.levers, 1)]
    lines.append(format_table(rows))
    lines += [f"  {i}. {lv.detail}" for i, lv in enumerate(d.levers, 1)]
    lines += [f"note: {note}" for note in d.notes]
    return "\n".join(lines)


def _rate_lines(d: Diagnosis) -> list[str]:
    lines = [""]
    if d.limits:
        lines.append(f"this machine, measured now: memory bandwidth {d.limits.bandwidth / 1e9:.1f} GB/s, "
                     f"matmul {d.limits.flops / 1e9:.0f} GFLOP/s")
    r = d.rates
    if r is None:
        return lines + ["(no local config for this model: bytes, FLOP/s and KV figures need --model naming a "
                        "checkpoint readable here)"]
    if r.decode_bytes_per_s:
        lines.append(f"decode: {fmt_bytes(r.decode_bytes_per_token)} read per decoded token (weights + KV at "
                     f"{r.decode_context:.0f} positions); {r.decode_bytes_per_s / 1e9:.2f} GB/s"
                     + (f" = {r.bandwidth_fraction:.0%} of bandwidth" if r.bandwidth_fraction else "")
                     + f"; {r.decode_flops_per_s / 1e9:.1f} GFLOP/s"
                     + (f" = {r.decode_flops_fraction:.0%} of peak matmul" if r.decode_flops_fraction else ""))
    if r.prefill_flops_per_s:
        lines.append(f"prefill: {r.prefill_flops / 1e9:.1f} GFLOP at {r.prefill_flops_per_s / 1e9:.1f} GFLOP/s"
                     + (f" = {r.flops_fraction:.0%} of peak matmul" if r.flops_fraction else ""))
    kv = d.kv
    if kv:
        line = (f"KV cache: {kv.bytes_per_token:,} B per token, {fmt_bytes(kv.bytes_per_sequence)} per "
                f"{kv.context}-token sequence")
        if kv.peak_usage is not None:
            line += f"; peak usage {kv.peak_usage:.1%} of the pool"
        if kv.capacity_sequences is not None:
            line += f"; the pool holds {kv.capacity_sequences:,} such sequences at once"
        lines.append(line)
    return lines


def diagnosis_figure(d: Diagnosis, model: str) -> Figure:
    s = d.split
    panels = [partial(draw_time_split, seconds={"queue": s.queue_s, "prefill": s.prefill_s, "decode": s.decode_s,
                                                "overhead": s.overhead_s})]
    if d.rates and d.limits:
        r, points = d.rates, []
        if r.prefill_flops_per_s:
            points.append(RooflinePoint("prefill", r.prefill_flops, r.prefill_bytes, s.prefill_wall_s))
        if s.mean_itl_s:
            points.append(RooflinePoint(f"decode, batch {d.workload.batch}", r.decode_step_flops,
                                        r.decode_step_bytes, s.mean_itl_s))
        panels.append(partial(draw_roofline, bandwidth=d.limits.bandwidth, peak_flops=d.limits.flops, points=points))
    return figure(panels, title=f"{model}: {d.verdict}")


def format_plan(p: MemoryPlan, arch_note: str) -> str:
    w = p.weights
    quant = f", {p.quantization}" + (f" g{p.group_size}" if p.quantization == "int4" else "") if p.quantization else ""
    kv_kind = "" if p.kv_cache_dtype == "auto" else f" ({p.kv_cache_dtype})"
    rows = [("parameters", f"{w.params:,}{arch_note}"),
            (f"weights ({p.dtype}{quant})", fmt_bytes(w.resident)),
            *([("read per decoded token (routed experts; no embedding rows)", f"{w.active_params:,} parameters, "
                f"{fmt_bytes(w.active_resident)} read per decoded token")] if w.active_params < w.params else []),
            (f"KV cache per token{kv_kind}", f"{p.kv_bytes_per_token:,} B = {p.kv_bytes_per_token / 2**20:.3g} MiB"),
            *([("recurrent states per sequence (any length)", fmt_bytes(p.state_bytes_per_sequence))]
              if p.state_bytes_per_sequence else []),
            (f"KV per {p.context:,}-token sequence", fmt_bytes(p.kv_bytes_per_sequence)),
            (f"weights + KV of {p.batch} sequence(s)", fmt_bytes(p.total_bytes)),
            (f"a step's activations ({p.step_tokens:,} tokens)", fmt_bytes(p.step_bytes)),
            ("the process at its peak (+ runtime)", fmt_bytes(p.process_bytes))]
    if p.memory is not None:
        verdict = "fits" if p.fits else "does not fit"
        rows.append((f"in {fmt_bytes(p.memory)}", f"{verdict}: at most {p.max_sequences:,} concurrent sequences "
                     f"of {p.context:,} tokens"))
    width = max(len(key) for key, _ in rows)
    lines = [f"llmpipe memory: {p.model}"] + [f"  {key.ljust(width)}  {value}" for key, value in rows]
    if p.hybrid:
        lines += ["cache per sequence by layer kind, against a dense model of the same shape (every layer full attention):",
                  format_table([["context", "full-attention K/V", "linear-attention states", "total", "dense", "ratio"]]
                               + [[f"{r.context:,}", _binary(r.attention_bytes), _binary(r.state_bytes),
                                   _binary(r.attention_bytes + r.state_bytes), _binary(r.dense_bytes), f"{r.ratio:.3f}"]
                                  for r in p.hybrid])]
    return "\n".join(lines + [f"note: {note}" for note in p.notes])


def _binary(n: float) -> str:
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024**power:
            return f"{n / 1024**power:.3f} {unit}"
    return f"{n:,.0f} B"


def _per_token(n: float) -> str:
    return f"{n:,.0f} B" if n == int(n) else f"{n:,.2f} B"


def format_compressed_plan(p: CompressedKVPlan) -> str:
    rows = [["layer kind", "layers", "per token", "window", "entries", "indexer", "pending",
             f"at {p.context:,} tokens"]]
    rows += [[k.kind, str(k.layers), _per_token(k.bytes_per_token), _binary(k.window), _binary(k.entries),
              _binary(k.indexer), _binary(k.pending), _binary(k.total)] for k in p.kinds]
    rows.append(["total", str(sum(k.layers for k in p.kinds)), _per_token(p.kv_bytes_per_token), *[""] * 4,
                 _binary(p.kv_bytes_per_sequence)])
    lines = [f"llmpipe memory: {p.model}, KV cache in {p.dtype} (config only: no weights)", format_table(rows),
             f"KV of {p.batch} sequence(s) of {p.context:,} tokens: {p.total_bytes:,} B = {fmt_bytes(p.total_bytes)}"]
    return "\n".join(lines + [f"note: {note}" for note in p.notes])
