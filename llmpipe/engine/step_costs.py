"""StepCosts: how long a decode-only step takes and what each prefill token adds, as measured.

A step that carries prefill chunks beside running decodes makes every stream wait for them: a
128-token prompt can cost three decode steps. With `EngineConfig.max_decode_stall` the core keeps
such a step to about that many times a decode-only step, capping the prefill tokens it schedules
beside decodes from these running estimates (the rest of the prompt follows in later steps).
"""

from __future__ import annotations

SMOOTHING = 0.2  # weight of the newest step in the running means
MIN_PREFILL_CHUNK = 16  # never fewer prefill tokens than this beside decodes: prompts must progress


class StepCosts:
    def __init__(self, max_stall: float | None) -> None:
        self.max_stall = max_stall
        self.decode_s: float | None = None  # a decode-only step
        self.prefill_token_s: float | None = None  # what one prefill token adds to a step

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        if num_prefill_tokens == 0:
            if num_decodes:
                self.decode_s = _mean(self.decode_s, seconds)
            return
        base = self.decode_s if num_decodes else 0.0
        if base is not None and num_prefill_tokens >= MIN_PREFILL_CHUNK:
            self.prefill_token_s = _mean(self.prefill_token_s, max(seconds - base, 0.0) / num_prefill_tokens)

    def prefill_budget(self) -> int | None:
        """Prefill tokens a step may carry beside decodes; None: no cap (off, or nothing measured yet)."""
        if self.max_stall is None or not self.decode_s or not self.prefill_token_s:
            return None
        return max(MIN_PREFILL_CHUNK, int((self.max_stall - 1) * self.decode_s / self.prefill_token_s))


def _mean(current: float | None, value: float) -> float:
    return value if current is None else (1 - SMOOTHING) * current + SMOOTHING * value
