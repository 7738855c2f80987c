"""`llmpipe bench window`: what sliding-window layers save. For each context length, one sequence is
prefilled and decoded with the model's windows (window layers free the blocks they no longer reach)
and with every layer forced to full attention; reported: the KV bytes the engine says the sequence
holds, and the decode inter-token latency, with the window/full ratios."""

from __future__ import annotations

import gc
import statistics
import time

from llmpipe.bench.report import format_table, random_prompt, write_json
from llmpipe.engine.engine import LLMEngine
from llmpipe.llm import LLM
from llmpipe.sampling_params import SamplingParams


def measure(engine: LLMEngine, context: int, decode_tokens: int) -> dict:
    """Prefill `context` random tokens, decode; KV bytes held after the last step, median step time."""
    prompt = random_prompt(engine.config.model_config.vocab_size, context, seed=context)
    engine.add_request("window-bench", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True))
    steps, held = [], 0
    while engine.has_unfinished_requests():
        decoding = bool(engine.scheduler.running) and not engine.scheduler.running[0].in_prefill
        start = time.perf_counter()
        engine.step()
        if decoding:
            steps.append(time.perf_counter() - start)
        held = engine.stats().kv_bytes_per_seq.get("window-bench", held)
    return {"kv_bytes_per_seq": held, "decode_itl_ms": 1000 * statistics.median(steps), "tokens": context + decode_tokens}


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
