"""Sliding-window perplexity against Hugging Face's strided recipe run on transformers."""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from llmpipe import LLM
from llmpipe.cli import main
from llmpipe.errors import InvalidRequestError
from llmpipe.eval.perplexity import TEXT, perplexity, windows


@pytest.mark.parametrize(
    "num_tokens,context,stride,expected",
    [
        (10, 4, 2, [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]),  # every token but the first, once
        (10, 4, 4, [(0, 4, 1), (4, 8, 5), (8, 10, 9)]),  # no overlap: each window's first token goes unscored
        (3, 8, 4, [(0, 3, 1)]),
    ],
)
def test_windows_by_hand(num_tokens, context, stride, expected):
    assert windows(num_tokens, context, stride) == expected


def test_stride_longer_than_the_context_is_refused():
    with pytest.raises(InvalidRequestError, match="stride <= context"):
        windows(100, 8, 16)


def transformers_strided_perplexity(model, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """The recipe of transformers' "Perplexity of fixed-length models" guide, summing the loss."""
    encodings = torch.tensor([ids])
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        trg_len = end - prev_end
        input_ids = encodings[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            logits = model(input_ids).logits
        labels = target_ids[0, 1:]
        nll_sum += F.cross_entropy(logits[0, :-1], labels, ignore_index=-100, reduction="sum").item()
        n_tokens += int((labels != -100).sum())
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / n_tokens), n_tokens


@pytest.mark.parametrize("context,stride", [(64, 32), (64, 64), (50, 17)])
def test_perplexity_equals_transformers_strided_recipe(tiny_checkpoint, context, stride):
    path = tiny_checkpoint("llama_gqa")
    llm = LLM(str(path), progress=False, quantization=None)
    ids = llm.get_tokenizer().encode(TEXT.read_text(encoding="utf-8"))[:300]
    ours = perplexity(llm.engine, ids, context, stride, progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected, n_tokens = transformers_strided_perplexity(reference, ids, context, stride)
    assert ours.num_tokens == n_tokens
    assert ours.perplexity == pytest.approx(expected, rel=1e-5)


def test_eval_command_refuses_bad_windows_in_one_line(tiny_checkpoint, capsys):
    argv = ["eval", "perplexity", "--model", str(tiny_checkpoint("llama_gqa")), "--context", "1", "--stride", "1"]
    assert main(argv) == 1
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert last == "llmpipe: error: need context >= 2 and 1 <= stride <= context, got context=1, stride=1"
