"""Sliding-window perplexity, Hugging Face's strided method ("Perplexity of fixed-length models").

Windows of `context` tokens start every `stride` tokens. Each window scores only the tokens the
previous one did not, so every token is scored once, with up to context − stride tokens of
context in front of it (the whole window for the first). A window's first token has no context
in the window and is never scored. Perplexity = exp(mean negative log-likelihood).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from llmpipe.errors import InvalidRequestError

TEXT = Path(__file__).resolve().parent / "data" / "hamlet.txt"


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    num_tokens: int  # tokens scored
    num_windows: int


def windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over tokens 0..num_tokens."""
    if context < 2 or not 1 <= stride <= context:
        raise InvalidRequestError(f"need context >= 2 and 1 <= stride <= context, got context={context}, stride={stride}")
    spans, scored_up_to = [], 0
    for begin in range(0, num_tokens - 1, stride):
        end = min(begin + context, num_tokens)
        spans.append((begin, end, max(scored_up_to, begin + 1)))
        scored_up_to = end
        if end == num_tokens:
            break
    return spans


def perplexity(engine, token_ids: list[int], context: int, stride: int, progress: bool = True) -> PerplexityResult:
    """Perplexity of token_ids under engine's model, computed with LLMEngine.score per window."""
    if len(token_ids) < 2:
        raise InvalidRequestError(f"perplexity needs at least 2 tokens, got {len(token_ids)}")
    spans = windows(len(token_ids), context, stride)
    total, count = 0.0, 0
    for begin, end, first in tqdm(spans, desc="Perplexity", unit="window", disable=not progress):
        logits = engine.score(token_ids[begin:end])  # row p predicts token begin + p + 1
        targets = torch.tensor(token_ids[first:end])
        logprobs = logits[first - begin - 1 : end - begin - 1].float().log_softmax(dim=-1)
        total -= logprobs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return PerplexityResult(math.exp(total / count), total / count, count, len(spans))
