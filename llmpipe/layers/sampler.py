"""Sampler: penalties → temperature → top-k / top-p / min-p → per-request seeded draw (or argmax).

Works on a batch of rows, one per sequence, each with its own SamplingParams: the rules every row has
(temperature, top-k, top-p, min-p, greedy) as tensors over the batch (SamplingTensors, which the engine
keeps per slot: engine/input_batch.py), the rest (penalties, logit bias, bans, grammar bitmasks, the
seeded generator) per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from llmpipe.errors import LLMPipeError
from llmpipe.kernels import ops
from llmpipe.sampling_params import SamplingParams
from llmpipe.structured_output.bitmask import allowed_tokens, any_token_left


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence this step."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    banned_token_ids: Sequence[int] = ()  # EOS / stop ids while under min_tokens
    # Structured outputs: the tokens the grammar allows next (int32 words, bit i = token i), or None.
    token_bitmask: np.ndarray | None = None


@dataclass
class SamplingTensors:
    """Each row's temperature (1.0 on greedy rows), top-k (0: off), top-p, min-p and greedy flag."""

    temperature: torch.Tensor  # float32 [rows]
    top_k: torch.Tensor  # int64 [rows]
    top_p: torch.Tensor  # float32 [rows]
    min_p: torch.Tensor  # float32 [rows]
    greedy: torch.Tensor  # bool [rows]

    DTYPES = (torch.float32, torch.int64, torch.float32, torch.float32, torch.bool)

    @staticmethod
    def values(params: SamplingParams) -> tuple[float, int, float, float, bool]:
        """One row's entries, in field order."""
        return 1.0 if params.greedy else params.temperature, params.top_k, params.top_p, params.min_p, params.greedy

    @classmethod
    def empty(cls, rows: int) -> SamplingTensors:
        return cls(*(torch.zeros(rows, dtype=dtype) for dtype in cls.DTYPES))

    @classmethod
    def of(cls, rows: Sequence[SamplingRow]) -> SamplingTensors:
        """Built from the rows (a draft's positions, a row sampled alone); the engine's batch gathers its slots."""
        columns = zip(*(cls.values(row.params) for row in rows))
        return cls(*(torch.tensor(column, dtype=dtype) for column, dtype in zip(columns, cls.DTYPES)))

    def write(self, row: int, params: SamplingParams) -> None:
        for tensor, value in zip(self.columns, self.values(params)):
            tensor[row] = value

    def take(self, rows: torch.Tensor) -> SamplingTensors:
        return SamplingTensors(*(tensor.index_select(0, rows) for tensor in self.columns))

    @property
    def columns(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p, self.greedy


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the chosen token, its rank, [(token id, logprob)] top-N), or None.
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt + output; presence / frequency penalties over output (vLLM's rules)."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.uses_penalties:
            continue
        out_ids = torch.tensor(list(row.output_token_ids), dtype=torch.long, device=logits.device)
        counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(list(row.prompt_token_ids), dtype=torch.long, device=logits.device)] = True
            penalized = torch.where(logits[i] > 0, logits[i] / p.repetition_penalty, logits[i] * p.repetition_penalty)
            logits[i] = torch.where(seen, penalized, logits[i])
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


# The most likely tokens ranked first: a top-k / nucleus / min-p set that ends within them needs no sort of
# the whole vocabulary (a [16, 49152] sort took ~50 ms a step on 2 cores; a decode step of SmolLM2, ~15).
CANDIDATES = 256


def filter_top_k_top_p_min_p(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k, nucleus (top-p) and min-p sets."""
    device, vocab = logits.device, logits.shape[-1]
    top_k = torch.where(tensors.top_k > 0, tensors.top_k, vocab).to(device)
    top_p, min_p = (t.to(device, logits.dtype) for t in (tensors.top_p, tensors.min_p))
    probs = logits.softmax(dim=-1)
    width = min(vocab, max(CANDIDATES, int(tensors.top_k.max())))
    ranked, order = probs.topk(width, dim=-1)  # descending
    kept = _kept(ranked, top_k, top_p, min_p)
    if width < vocab and bool((kept[:, -1] & (top_k > width)).any()):  # a set may go on past them: rank them all
        ranked, order = probs.sort(dim=-1, descending=True)
        kept = _kept(ranked, top_k, top_p, min_p)
    return torch.full_like(logits, float("-inf")).scatter(-1, order, logits.gather(-1, order).masked_fill(~kept, float("-inf")))


def _kept(ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Which of each row's ranked probabilities the three rules keep. Each rule drops a suffix of the
    ranking, so a row whose last candidate is dropped has dropped every token past the candidates too."""
    rank = torch.arange(ranked.shape[-1], device=ranked.device).expand_as(ranked)
    mass_before = ranked.cumsum(dim=-1) - ranked
    drop = (rank >= top_k[:, None]) | (mass_before >= top_p[:, None]) | (ranked < min_p[:, None] * ranked[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    return ~drop


def topn_logprobs(raw: torch.Tensor, chosen: list[int], rows: Sequence[SamplingRow]):
    wanted = [r.params.logprobs for r in rows]
    if all(n is None for n in wanted):
        return [None] * len(rows)
    logprobs = raw.float().log_softmax(dim=-1)
    by_n: dict[int, list[int]] = {}  # rows asking the same top-n share one gather and topk
    for i, n in enumerate(wanted):
        if n is not None:
            by_n.setdefault(n, []).append(i)
    result: list = [None] * len(rows)
    for n, group in by_n.items():
        for i, entry in zip(group, ranked_logprobs(logprobs[group], [chosen[i] for i in group], n)):
            result[i] = entry
    return result


def ranked_logprobs(logprobs: torch.Tensor, chosen: Sequence[int], n: int) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Per row of logprobs [rows, vocab]: (the chosen token's logprob, its rank, the top-n (token id,
    logprob) pairs)."""
    index = torch.tensor(list(chosen), dtype=torch.long, device=logprobs.device)
    picked = logprobs.gather(1, index[:, None])
    ranks = ((logprobs > picked).sum(dim=-1) + 1).tolist()
    pairs: list[list[tuple[int, float]]] = [[] for _ in ranks]
    if n > 0:
        top = logprobs.topk(n, dim=-1)
        pairs = [list(zip(ids, values)) for ids, values in zip(top.indices.tolist(), top.values.tolist())]
    return list(zip(picked[:, 0].tolist(), ranks, pairs))


def adjusted_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """float32 logits after penalties, logit_bias, the min_tokens bans and structured outputs' token
    bitmasks: what every rule below starts from."""
    logits = logits.float()
    if any(r.params.uses_penalties or r.banned_token_ids or r.params.logit_bias for r in rows):
        logits = apply_penalties(logits.clone(), rows)
        for i, row in enumerate(rows):
            if row.params.logit_bias:
                ids = torch.tensor(list(row.params.logit_bias), dtype=torch.long, device=logits.device)
                bias = torch.tensor(list(row.params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[i].index_add_(0, ids, bias)
            if row.banned_token_ids:
                logits[i, list(row.banned_token_ids)] = float("-inf")
    if any(r.token_bitmask is not None for r in rows):
        logits = apply_token_bitmasks(logits, rows)
    return logits


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, torch.argmax(dim=-1)'s indices (first maximum; first NaN where one is), for
    [rows, vocab]: float32 CPU rows take the C kernel (kernels/csrc/greedy_argmax.c), several times faster
    than PyTorch's on a large vocabulary."""
    if not ops.available() or logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    return ops.greedy_argmax(logits.contiguous())


class DeadEndError(LLMPipeError):
    """No token may follow: the grammar allows none that the other rules (min_tokens) leave."""


def apply_token_bitmasks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """-inf wherever a row's grammar forbids the token. DeadEndError when a row keeps none
    (sampling it would draw from NaNs)."""
    masked = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
    for i in masked:
        if not any_token_left(rows[i].token_bitmask, rows[i].banned_token_ids):
            why = ": min_tokens bans EOS where the grammar can only end" if rows[i].banned_token_ids else ""
            raise DeadEndError(f"structured_outputs: the grammar allows no next token here (a dead end{why})")
    allowed = allowed_tokens([rows[i].token_bitmask for i in masked], logits.shape[-1], logits.device)
    kept = torch.where(allowed, logits[masked], float("-inf"))
    if len(masked) == len(rows):
        return kept
    logits = logits.clone()
    logits[masked] = kept
    return logits


def distribution(adjusted: torch.Tensor, rows: Sequence[SamplingRow], argmax: torch.Tensor | None = None,
                 tensors: SamplingTensors | None = None) -> torch.Tensor:
    """The probabilities each row's token is drawn from: temperature, then top-k / top-p / min-p.
    A greedy row is a point mass on its argmax (`argmax`: argmax_rows(adjusted), where the caller has it).
    `tensors`: the rows' SamplingTensors, where the caller keeps them."""
    tensors = SamplingTensors.of(rows) if tensors is None else tensors
    scaled = adjusted / tensors.temperature.to(adjusted.device)[:, None]
    if any(r.params.uses_filters for r in rows):  # a ranking of the vocabulary: only when asked for
        scaled = filter_top_k_top_p_min_p(scaled, tensors)
    probs = scaled.softmax(dim=-1)
    if any(r.params.greedy for r in rows):
        greedy = tensors.greedy.to(adjusted.device)
        argmax = argmax_rows(adjusted) if argmax is None else argmax
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax[:, None], 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from probs [vocab] (any non-negative weights): inverse CDF of one uniform draw.
    (torch.multinomial takes milliseconds on a 50K vocabulary; this takes a cumsum.)"""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator, device=probs.device)
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), len(cdf) - 1)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], tensors: SamplingTensors | None = None) -> SampleResult:
    """logits: [rows, vocab] from the LM head. Returns one token per row. `tensors`: the rows'
    SamplingTensors, where the caller keeps them (built from the rows otherwise)."""
    adjusted = adjusted_logits(logits, rows)
    argmax = argmax_rows(adjusted) if any(r.params.greedy for r in rows) else None
    greedy = argmax.tolist() if argmax is not None else []
    if all(r.params.greedy for r in rows):
        return SampleResult(greedy, topn_logprobs(logits, greedy, rows))
    probs = distribution(adjusted, rows, argmax, tensors)
    chosen = [greedy[i] if row.params.greedy else draw(probs[i], row.generator) for i, row in enumerate(rows)]
    return SampleResult(chosen, topn_logprobs(logits, chosen, rows))
