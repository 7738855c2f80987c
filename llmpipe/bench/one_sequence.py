"""One sequence alone in the engine, prefilled then decoded: the KV bytes the engine says it holds and
its step times (`bench window` and `bench compressed` run it per context length)."""

from __future__ import annotations

import statistics
import time

from llmpipe.bench.report import random_prompt
from llmpipe.engine.engine import LLMEngine
from llmpipe.sampling_params import SamplingParams


def measure(engine: LLMEngine, context: int, decode_tokens: int, request_id: str = "kv-bench") -> dict:
    """Prefill `context` random tokens, decode `decode_tokens` more. KV bytes are those held after the
    last step the sequence was still running (`tokens`: how many it had computed then); the decode ITL is
    the median decode step."""
    prompt = random_prompt(engine.config.model_config.vocab_size, context, seed=context)
    engine.add_request(request_id, {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True))
    steps, prefill_s, held, tokens = [], 0.0, 0, 0
    while engine.has_unfinished_requests():
        decoding = bool(engine.core.scheduler.running) and not engine.core.scheduler.running[0].in_prefill
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if decoding:
            steps.append(elapsed)
        else:
            prefill_s += elapsed
        per_seq = engine.stats().kv_bytes_per_seq
        if request_id in per_seq:
            seq = next(s for s in engine.core.scheduler.running if s.request_id == request_id)
            held, tokens = per_seq[request_id], seq.num_computed_tokens
    return {"kv_bytes_per_seq": held, "tokens": tokens, "prefill_s": prefill_s,
            "decode_itl_ms": 1000 * statistics.median(steps)}
