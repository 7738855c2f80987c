"""`llmpipe bench window`: what sliding-window layers save. For each context length, one sequence is
prefilled and decoded with the model's windows (window layers free the blocks they no longer reach)
and with every layer forced to full attention; reported: the KV bytes the engine says the sequence
holds, and the decode inter-token latency, with the window/full ratios."""

from __future__ import annotations

import gc

from llmpipe.bench.one_sequence import measure
from llmpipe.bench.report import format_table, write_json
from llmpipe.llm import LLM


def main(args) -> None:
    rows = [["context", "KV/seq window (MiB)", "KV/seq full (MiB)", "ratio", "ITL window (ms)", "ITL full (ms)", "ratio"]]
    report: dict = {"model": args.model, "contexts": {}}
    results: dict[str, dict[int, dict]] = {}
    for mode in ("window", "full"):
        llm = LLM(args.model, disable_sliding_window=mode == "full", kv_cache_memory=args.kv_cache_memory,
                  max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
        results[mode] = {context: measure(llm.engine, context, args.decode_tokens) for context in args.contexts}
        del llm
        gc.collect()
    for context in args.contexts:
        w, f = results["window"][context], results["full"][context]
        report["contexts"][context] = {"window": w, "full": f}
        rows.append([
            str(context), f"{w['kv_bytes_per_seq'] / 2**20:.1f}", f"{f['kv_bytes_per_seq'] / 2**20:.1f}",
            f"{w['kv_bytes_per_seq'] / f['kv_bytes_per_seq']:.2f}", f"{w['decode_itl_ms']:.1f}",
            f"{f['decode_itl_ms']:.1f}", f"{w['decode_itl_ms'] / f['decode_itl_ms']:.2f}",
        ])
    print(format_table(rows))
    print(f"wrote {write_json(args.output, report)}")
