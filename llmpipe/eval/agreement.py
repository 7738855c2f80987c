"""How closely one engine configuration follows a reference one: the bar a fast path
against before it may become the default ("its logits agree with the exact path as llama.cpp's agree
with transformers").

- Logits: both engines score the same windows of a text (`LLMEngine.score`, every position); the
  Pearson correlation over every position's logits, the share of positions with the same top token,
  and the largest logit difference.
- Greedy decoding: both engines decode the same prompts greedily. Where the candidate's tokens first
  differ, the reference's top-2 logit margin at that step says whether it was a near tie.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from llmpipe.engine.engine import LLMEngine
from llmpipe.sampling_params import SamplingParams


@dataclass
class Divergence:
    prompt: int  # index into the prompts
    step: int | None  # the first generated token that differs; None: all the same
    reference_margin: float | None  # the reference's top-1 minus top-2 logit there


@dataclass
class AgreementResult:
    correlation: float  # Pearson, over every scored position's logits
    top1_agreement: float  # share of scored positions whose top token is the same
    max_abs_logit_diff: float
    num_positions: int
    divergences: list[Divergence] = field(default_factory=list)

    def meets(self, min_correlation: float = 0.998, near_tie: float = 0.2) -> bool:
        """The bar: correlation at least `min_correlation`, and every greedy divergence a near tie."""
        ties = all(d.step is None or (d.reference_margin or 0.0) < near_tie for d in self.divergences)
        return self.correlation >= min_correlation and ties

    def to_dict(self) -> dict:
        return asdict(self) | {"meets_bar": self.meets()}


def logit_agreement(candidate: LLMEngine, reference: LLMEngine, token_ids: list[int], context: int,
                    windows: int, progress: bool = True) -> tuple[float, float, float, int]:
    """(correlation, top-1 agreement, max |difference|, positions) over `windows` windows of `context` tokens."""
    sums = torch.zeros(5, dtype=torch.float64)  # x, y, x², y², xy
    count, same, worst, positions = 0, 0, 0.0, 0
    spans = [(b, b + context) for b in range(0, len(token_ids) - context + 1, context)][:windows]
    for begin, end in tqdm(spans, desc="Logits", unit="window", disable=not progress):
        x = candidate.score(token_ids[begin:end]).double()
        y = reference.score(token_ids[begin:end]).double()
        sums += torch.stack([x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()])
        count += x.numel()
        same += int((x.argmax(-1) == y.argmax(-1)).sum())
        worst = max(worst, float((x - y).abs().max()))
        positions += x.shape[0]
    sx, sy, sxx, syy, sxy = (s.item() / count for s in sums)
    correlation = (sxy - sx * sy) / ((sxx - sx * sx) ** 0.5 * (syy - sy * sy) ** 0.5)
    return correlation, same / positions, worst, positions


def greedy_divergences(candidate: LLMEngine, reference: LLMEngine, prompts: list[list[int]],
                       max_tokens: int) -> list[Divergence]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    ours, theirs = _generate(candidate, prompts, params), _generate(reference, prompts, params)
    divergences = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        step = next((s for s, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        margin = None
        if step is not None:
            top = sorted((p.logprob for p in b.logprobs[step].values()), reverse=True)
            margin = top[0] - top[1]
        divergences.append(Divergence(i, step, margin))
    return divergences


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = [f"agreement-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    return [finished[i] for i in ids]
