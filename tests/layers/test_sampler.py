"""The sampler against independent numpy references and statistical tests."""

import numpy as np
import pytest
import torch
from scipy import stats

from llmpipe.layers.sampler import SamplingRow, SamplingTensors, apply_penalties, argmax_rows, filter_top_k_top_p_min_p, sample
from llmpipe.sampling_params import SamplingParams


def reference_filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """Textbook top-k / nucleus / min-p on one row of logits, written independently of the sampler."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    mass = 0.0
    for rank, tok in enumerate(order):
        if (top_k and rank >= top_k) or (rank > 0 and mass >= top_p) or (rank > 0 and p[tok] < min_p * p[order[0]]):
            continue
        keep[tok] = True
        mass += p[tok]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def row(params, prompt=(), output=()):
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingRow(params, gen, list(prompt), list(output))


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(1.0, 0, 0.8, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 1.0, 0.1), (0.9, 8, 0.9, 0.05)]
)
def test_filter_matches_reference_distribution(temperature, top_k, top_p, min_p):
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    filtered = filter_top_k_top_p_min_p(logits / temperature, SamplingTensors.of([row(params)]))
    ours = filtered.softmax(-1)[0].double().numpy()
    expected = reference_filtered_probs(logits[0].numpy(), temperature, top_k, top_p, min_p)
    np.testing.assert_allclose(ours, expected, atol=1e-6)


@pytest.mark.parametrize("spread", [4.0, 0.3], ids=["peaked: the sets end within the candidates", "flat: they reach past them"])
def test_filter_of_a_batch_over_a_large_vocabulary_matches_the_reference(spread):
    """A batch mixing rules over 5,000 tokens: rows whose sets end among the most likely CANDIDATES tokens and,
    with a flat distribution, rows whose nucleus goes on past them (ranked in full) give the reference's sets."""
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(5)) * spread
    settings = [(1.0, 0, 0.95, 0.0), (0.8, 300, 1.0, 0.0), (1.2, 0, 1.0, 0.02), (0.9, 40, 0.99, 0.01)]
    rows = [row(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)) for t, k, p, m in settings]
    scaled = logits / torch.tensor([t for t, *_ in settings])[:, None]
    filtered = filter_top_k_top_p_min_p(scaled, SamplingTensors.of(rows))
    for i, (t, k, p, m) in enumerate(settings):
        expected = reference_filtered_probs(logits[i].numpy(), t, k, p, m)
        np.testing.assert_allclose(filtered[i].softmax(-1).double().numpy(), expected, atol=1e-6)


def test_sampled_frequencies_follow_filtered_distribution():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(7)) * 1.5
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    r = row(params)
    draws = [sample(logits, [r]).token_ids[0] for _ in range(20000)]
    expected = reference_filtered_probs(logits[0].numpy(), 0.8, 0, 0.9, 0.0)
    support = expected > 0
    observed = np.bincount(draws, minlength=30)
    assert observed[~support].sum() == 0, "sampled a token the filters removed"
    _, p_value = stats.chisquare(observed[support], expected[support] * len(draws))
    assert p_value > 0.001


def test_fixed_seed_gives_identical_draws_and_other_seed_differs():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(0))

    def draws(seed):
        r = row(SamplingParams(temperature=1.0, seed=seed))
        return [sample(logits, [r]).token_ids[0] for _ in range(50)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def test_top_k_one_is_greedy():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    rows = [row(SamplingParams(temperature=1.5, top_k=1, seed=i)) for i in range(4)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_penalties_follow_vllm_rules():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), [row(params, prompt=[0], output=[1, 1, 3])])
    # token 0: in prompt → 2.0/2; token 1: seen twice → -1*2 - 0.25*2 - 0.5; token 3: once → 3/2 - 0.25 - 0.5
    expected = torch.tensor([[1.0, -2.0 - 0.5 - 0.5, 0.5, 1.5 - 0.25 - 0.5, -2.0]])
    torch.testing.assert_close(out, expected)


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    r = SamplingRow(SamplingParams(temperature=0.0), None, [], [], banned_token_ids=[0])
    assert sample(logits, [r]).token_ids == [1]


def test_logprobs_report_chosen_token_rank_and_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    result = sample(logits, [row(SamplingParams(temperature=0.0, logprobs=2))])
    chosen_lp, rank, top = result.logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert result.token_ids == [1] and rank == 1
    assert chosen_lp == pytest.approx(expected[1].item())
    assert [t for t, _ in top] == [1, 2]


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0),
     ("n", 0), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("logprobs", -1), ("min_tokens", -1)],
)
def test_invalid_sampling_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_adds_to_the_logits_before_every_rule():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(temperature=0.0, logit_bias={3: 4.0, 0: -1.5}, logprobs=1)
    result = sample(logits, [row(params)])
    assert result.token_ids == [3]  # -1 + 4 = 3 beats 2 - 1.5 and 1.0
    banned = SamplingRow(SamplingParams(temperature=0.0, logit_bias={1: 100.0}), None, [], [], banned_token_ids=[1])
    assert sample(logits, [banned]).token_ids == [0]  # a ban wins over any bias


@pytest.mark.parametrize("bias", [{0: 100.5}, {0: -101.0}, {"0": 1.0}])
def test_logit_bias_values_outside_openai_range_or_not_token_ids_are_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def argmax_cases() -> list[torch.Tensor]:
    """Rows for the greedy argmax: wide and narrow vocabularies, one row and many, ties (the first one
    wins), -inf everywhere, a NaN (torch.argmax's pick: the first NaN), a maximum in a tail past the
    last whole vector."""
    torch.manual_seed(0)
    cases = [torch.randn(rows, vocab) for rows, vocab in ((1, 262_144), (1, 49_152), (5, 49_152), (3, 13), (1, 1), (2, 7))]
    ties = torch.randn(4, 1000)
    ties[:, [17, 300, 999]] = 9.0
    ties[1, 5] = 9.0
    ties[2, :] = 0.0
    lone = torch.full((2, 1003), float("-inf"))
    lone[1, 1001] = -1.0
    nan = torch.randn(3, 5000)
    nan[0, [40, 4000]] = float("nan")
    nan[2, 4999] = float("nan")
    one_row_split = torch.randn(1, 100_003)
    one_row_split[0, [77_000, 99_999]] = 50.0  # a later part holds the maximum twice
    one_row_nan = torch.randn(1, 100_000)
    one_row_nan[0, [60_000, 90_000]] = float("nan")
    return cases + [ties, lone, nan, one_row_split, one_row_nan]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_greedy_argmax_is_torch_argmax_on_every_row(threads):
    from llmpipe.kernels.build import library

    if library() is None:
        pytest.skip("needs AVX2 + FMA, a C compiler and ninja")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for logits in argmax_cases():
            assert torch.equal(library().greedy_argmax(logits), logits.argmax(dim=-1)), logits.shape
            assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(argmax_rows(torch.tensor([[1.0, 3.0, 3.0]], dtype=torch.float64)), torch.tensor([1]))  # PyTorch's
