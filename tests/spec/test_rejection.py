"""Rejection sampling keeps the target distribution exactly, whatever the draft proposes."""

import pytest
import torch

from llmpipe.layers.sampler import SamplingRow
from llmpipe.sampling_params import SamplingParams
from llmpipe.spec import Proposal, verify

VOCAB = 6
TRIALS = 6_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities (all cells expected ≥ 5)."""
    expected = probs.double() * counts.sum()
    statistic = ((counts.double() - expected) ** 2 / expected).sum()
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def rows(n: int, generator: torch.Generator, **params) -> list[SamplingRow]:
    return [SamplingRow(SamplingParams(**params), generator, [], []) for _ in range(n)]


@pytest.mark.parametrize("draft", ["bad", "point_mass"])
def test_first_two_emitted_tokens_follow_the_target(draft):
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 0.2, 1.5, 0.0, 0.7, -0.5], [1.0] * VOCAB])
    p = logits.softmax(-1)
    # The bad draft puts 90% on a token the target gives 5%, and nothing where the target's mass is.
    q = torch.tensor([[0.0, 0.0, 0.0, 0.05, 0.9, 0.05]] * 2) if draft == "bad" else None
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    guesses = torch.tensor([[4, 2]]).expand(TRIALS, 2) if q is None else torch.multinomial(q, TRIALS, True, generator=generator).T
    for guess in guesses.tolist():
        proposal = Proposal(guess, q)  # without q: a fixed guess, as n-gram lookup makes
        tokens = verify(logits, rows(3, generator, temperature=1.0), proposal)
        first[tokens[0]] += 1
        if tokens[0] == proposal.token_ids[0]:  # the target's row 1 assumed this first token
            second[tokens[1]] += 1
    assert chi_square_p_value(first, p[0]) > 0.01
    assert chi_square_p_value(second, p[1]) > 0.01


def test_greedy_accepts_while_the_argmax_matches():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = rows(3, None, temperature=0.0)
    assert verify(logits, greedy, Proposal([1, 0])) == [1, 0, 2]  # all accepted, then the bonus
    assert verify(logits, greedy, Proposal([1, 2])) == [1, 0]  # corrected at the first mismatch
    assert verify(logits, greedy, Proposal([2, 0])) == [1]
