"""The tests every hybrid family's file runs beside the parity suite (a linear-attention state per sequence, next to
full-attention blocks), on its `case` fixture: chunked prefill cut anywhere, and prefix-cache hits under preemption.
A hybrid's test file imports them (`from tests.models.hybrid_suite import *`)."""

from __future__ import annotations

import pytest

from tests.models.parity_suite import GREEDY, assert_prefix_hits_and_preemption_keep_the_reference, like
from tests.utils import prompt, reference_greedy

__all__ = ["test_chunks_cutting_the_prompt_anywhere_continue_the_state",
           "test_prefix_cache_hits_and_preemption_give_the_reference_tokens"]


@pytest.mark.parametrize("chunk", [3, 7, 13])
def test_chunks_cutting_the_prompt_anywhere_continue_the_state(case, chunk):
    """Chunk boundaries that fall inside blocks and inside the conv's window: each chunk continues the last's state."""
    _, reference, _ = case
    tokens = prompt(29, 4)
    llm = like(case, max_num_batched_tokens=chunk, block_size=4)
    out = llm.generate([{"prompt_token_ids": tokens}], GREEDY)[0]
    assert out.outputs[0].token_ids == reference_greedy(reference, tokens)[0]


def test_prefix_cache_hits_and_preemption_give_the_reference_tokens(case):
    """Full-attention blocks and state checkpoints from one budget: 5 blocks hold two of the four sequences."""
    assert_prefix_hits_and_preemption_keep_the_reference(case, max_num_blocks=5)
