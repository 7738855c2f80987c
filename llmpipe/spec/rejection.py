"""Rejection sampling for speculative decoding (Leviathan et al., Chen et al., 2023).

Draft token x drawn from q is accepted with probability min(1, p(x) / q(x)); at the first
rejection the replacement is drawn from normalize(max(p − q, 0)); when all k are accepted a bonus
token is drawn from the target's next distribution. Every emitted token is then distributed exactly
as the target alone would have drawn it. For greedy rows p is a point mass on the target's argmax,
so this reduces to "accept while the argmax matches" and draws no random numbers.
"""

from __future__ import annotations

from typing import Sequence

import torch

from llmpipe.layers.sampler import SamplingRow, argmax_rows, distribution, draw
from llmpipe.spec.proposal import Proposal


def verify(adjusted: torch.Tensor, rows: Sequence[SamplingRow], proposal: Proposal) -> list[int]:
    """adjusted: the target's [k + 1, vocab] logits after penalties (row i: after the first i
    draft tokens); rows: the matching sampling rows. Returns the accepted draft tokens followed by
    one token from the target."""
    params, generator = rows[0].params, rows[0].generator
    if params.greedy:
        targets = argmax_rows(adjusted).tolist()
        accepted = 0
        while accepted < len(proposal.token_ids) and proposal.token_ids[accepted] == targets[accepted]:
            accepted += 1
        return proposal.token_ids[:accepted] + [targets[accepted]]
    p = distribution(adjusted, rows)
    emitted: list[int] = []
    for i, token in enumerate(proposal.token_ids):
        q = proposal.probs[i] if proposal.probs is not None else None
        q_token = 1.0 if q is None else float(q[token])
        p_token = float(p[i, token])
        if p_token >= q_token or (p_token > 0 and _uniform(generator) * q_token < p_token):
            emitted.append(token)
            continue
        if q is None:
            residual = p[i].clone()
            residual[token] = 0.0
        else:
            residual = (p[i] - q).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:  # only by rounding: p and q equal
            residual = p[i]
        return emitted + [draw(residual, generator)]
    return emitted + [draw(p[len(emitted)], generator)]


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))
