"""`llmpipe bench offload`: what the prefix cache's offload tiers buy — the TTFT of a long shared prompt that
the KV pool evicted, restored from host memory, and from disk after a restart, against computing it.

One process, one model, a KV pool a little larger than one prompt (so the next long prompt evicts it). Per
round, with prompts of their own: a prompt computed (its TTFT: the recompute baseline); another long prompt,
which evicts it from the pool; the first again (TTFT: restored from host memory). Then the engine is closed
and a new one opened on the same disk folder, with no memory tier: each prompt again (TTFT: restored from disk
after a restart; the files are in the page cache by then, as they would be on a machine that serves). Every
restored run's greedy tokens are checked against the computed run's. Ratios are computed / restored, medians
over the rounds.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
from pathlib import Path

from llmpipe.bench.report import write_json


def _prompt(seed: int, tokens: int, vocab: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(tokens)]}


def run_offload_bench(model: str, prompt_tokens: int, rounds: int, output: str, memory: str = "4GiB",
                      directory: str | None = None) -> dict:
    from llmpipe import LLM, SamplingParams

    folder = Path(directory or tempfile.mkdtemp(prefix="llmpipe-kv-offload-"))
    block = 16
    blocks = -(-prompt_tokens // block) * 6 // 5 + 8  # one prompt and a fifth: the next one evicts it
    options = dict(progress=False, max_num_blocks=blocks, kv_offload_dir=str(folder))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        llm = LLM(model, kv_offload_memory=memory, **options)
        vocab = llm.engine.config.model_config.vocab_size
        run = lambda p: llm.generate([p], params)[0]  # noqa: E731
        run(_prompt(10_000, 64, vocab))  # warm-up
        computed, memory_ttft, same, cached = [], [], [], []
        prompts = [_prompt(seed, prompt_tokens, vocab) for seed in range(rounds)]
        tokens = {}
        for i, p in enumerate(prompts):
            first = run(p)
            computed.append(first.metrics.ttft)
            tokens[i] = first.outputs[0].token_ids
            run(_prompt(20_000 + i, prompt_tokens, vocab))  # evicts p from the pool
            again = run(p)
            memory_ttft.append(again.metrics.ttft)
            same.append(again.outputs[0].token_ids == tokens[i])
            cached.append(again.num_cached_tokens)
        memory_stats = llm.engine.stats().kv_offload
        llm.close()
        restarted = LLM(model, **options)
        disk_ttft, disk_cached = [], []
        for i, p in enumerate(prompts):
            out = restarted.generate([p], params)[0]
            disk_ttft.append(out.metrics.ttft)
            disk_cached.append(out.num_cached_tokens)
            same.append(out.outputs[0].token_ids == tokens[i])
        disk_stats = restarted.engine.stats().kv_offload
        restarted.close()
    finally:
        if directory is None:
            shutil.rmtree(folder, ignore_errors=True)
    med = statistics.median
    report = {
        "model": model, "prompt_tokens": prompt_tokens, "rounds": rounds, "pool_blocks": blocks,
        "ttft_computed_s": computed, "ttft_memory_s": memory_ttft, "ttft_disk_after_restart_s": disk_ttft,
        "cached_tokens_memory": cached, "cached_tokens_disk": disk_cached,
        "speedup_memory": med(computed) / med(memory_ttft), "speedup_disk_after_restart": med(computed) / med(disk_ttft),
        "same_tokens": all(same), "memory_tier": vars(memory_stats), "disk_tier_after_restart": vars(disk_stats),
    }
    write_json(output, report)
    print(f"{model}: a {prompt_tokens}-token prompt evicted from the KV pool, TTFT (median of {rounds})")
    print(f"  computed                  {med(computed) * 1e3:9.1f} ms")
    print(f"  from host memory          {med(memory_ttft) * 1e3:9.1f} ms   {report['speedup_memory']:.1f}x faster")
    print(f"  from disk, after restart  {med(disk_ttft) * 1e3:9.1f} ms   {report['speedup_disk_after_restart']:.1f}x faster")
    print(f"  same greedy tokens: {report['same_tokens']}; written to {output}")
    return report
