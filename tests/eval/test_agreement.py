"""`llmpipe eval agreement`: logit correlation against numpy's, divergence margins against the
reference engine's own scores, and the command end to end."""

import json

import numpy as np
import pytest
import torch

from llmpipe import LLM, SamplingParams
from llmpipe.cli import main
from llmpipe.eval.agreement import AgreementResult, Divergence, greedy_divergences, logit_agreement
from llmpipe.kernels import ops


class Scores:
    """An engine stand-in whose score() returns fixed logits per window (by its first token)."""

    def __init__(self, logits: dict[int, torch.Tensor]):
        self.logits = logits

    def score(self, token_ids: list[int]) -> torch.Tensor:
        return self.logits[token_ids[0]]


def test_logit_statistics_equal_numpys():
    torch.manual_seed(0)
    ids = list(range(40))
    ours = {b: torch.randn(10, 7) for b in (0, 10, 20, 30)}
    theirs = {b: 0.8 * ours[b] + 0.3 * torch.randn(10, 7) for b in ours}
    correlation, top1, worst, positions = logit_agreement(Scores(ours), Scores(theirs), ids, 10, 3, progress=False)
    x = torch.cat([ours[b] for b in (0, 10, 20)]).numpy().ravel()  # 3 windows of the 4
    y = torch.cat([theirs[b] for b in (0, 10, 20)]).numpy().ravel()
    assert correlation == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-9)
    assert worst == pytest.approx(np.abs(x - y).max(), abs=1e-6) and positions == 30
    same = (x.reshape(30, 7).argmax(1) == y.reshape(30, 7).argmax(1)).mean()
    assert top1 == pytest.approx(same)


def test_the_bar_needs_the_correlation_and_only_near_ties():
    tie, clear = Divergence(0, 5, 0.1), Divergence(1, 3, 0.5)
    assert AgreementResult(0.999, 1.0, 0.1, 10, [tie, Divergence(2, None, None)]).meets()
    assert not AgreementResult(0.999, 1.0, 0.1, 10, [clear]).meets()
    assert not AgreementResult(0.99, 1.0, 0.1, 10, [tie]).meets()


def test_a_divergence_reports_the_reference_margin_at_that_step(tiny_checkpoint):
    """Two different models diverge; the margin reported is the reference's own top-2 logit gap after
    the common prefix, as its score() gives it."""
    reference = LLM(str(tiny_checkpoint("llama_gqa")), progress=False).engine
    other = LLM(str(tiny_checkpoint("llama_mha")), progress=False).engine
    prompts = [[5, 9, 33, 71, 2, 18], [40, 41, 42]]
    assert all(d.step is None for d in greedy_divergences(reference, reference, prompts, 12))
    found = [d for d in greedy_divergences(other, reference, prompts, 12) if d.step is not None]
    assert found
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for d in found:
        generated = _greedy(reference, prompts[d.prompt], params)
        top = reference.score(prompts[d.prompt] + generated[: d.step], last_only=True).reshape(-1).topk(2).values
        assert d.reference_margin == pytest.approx((top[0] - top[1]).item(), abs=1e-4)


def _greedy(engine, prompt, params, request_id=[0]):
    request_id[0] += 1
    engine.add_request(f"greedy-{request_id[0]}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return output.outputs[0].token_ids


@pytest.mark.skipif(not ops.dot_available(), reason="needs the integer-dot kernels")
def test_agreement_command_writes_its_figures(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "agreement.json"
    main(["eval", "agreement", "--model", str(tiny_checkpoint("llama_gqa")), "--quantization", "int4",
          "--group-size", "32", "--activation-quantization", "int16", "--context", "32", "--windows", "2",
          "--prompts", "2", "--max-new-tokens", "8", "--output", str(out)])
    result = json.loads(out.read_text())
    assert result["correlation"] > 0.999 and result["num_positions"] == 64 and len(result["divergences"]) == 2
    assert "logit correlation" in capsys.readouterr().out
