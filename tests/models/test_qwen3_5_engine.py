"""Qwen3.5 through the engine against transformers (float32, the tiny checkpoint of tests/utils.py): the shared
parity suite (prefill, decode, chunked at arbitrary cuts, batched), prefix-cache hits restoring a checkpointed state
under preemption, a chat's second turn resuming from the first's state, n > 1 forks copying the state, and the
cache's bytes from the engine's own stats. (Model-level tests with hand-built caches: test_qwen3_5.py.)"""

from __future__ import annotations

import pytest

from llmpipe import LLM, SamplingParams
from llmpipe.errors import UnsupportedModelError
from tests.models.hybrid_suite import *  # noqa: F403  (the hybrids' shared tests)
from tests.models.parity_suite import *  # noqa: F403  (the shared parity tests)
from tests.models.parity_suite import GREEDY, like
from tests.utils import prompt, reference_case, reference_greedy


@pytest.fixture(scope="module")
def case(tiny_checkpoint):
    return reference_case(tiny_checkpoint("qwen3_5"))


def test_a_chats_second_turn_resumes_from_the_first_turns_state(case):
    """The second turn's prompt is the first turn's prompt, its reply and a new message: its prefill starts at the
    newest checkpoint (the last block boundary the first turn's decode crossed), and its tokens are the reference's."""
    _, reference, _ = case
    llm = like(case, block_size=4)
    first = prompt(14, 2)
    reply = llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    second = first + reply[0].outputs[0].token_ids + prompt(6, 3)[1:]
    out = llm.generate([{"prompt_token_ids": second}], GREEDY)[0]
    assert out.num_cached_tokens == (14 + 9 - 1) // 4 * 4  # the state after the reply's last computed token's block
    assert out.outputs[0].token_ids == reference_greedy(reference, second)[0]


def test_n_samples_each_run_from_a_copy_of_the_prompts_state(case):
    """n = 3 greedy samples: each continues its own copy of the prompt's state (a state shared between them would
    advance three times a step and leave the reference at once)."""
    _, reference, _ = case
    tokens = prompt(11, 6)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=16, ignore_eos=True)
    out = like(case).generate([{"prompt_token_ids": tokens}], params)[0]
    expected = reference_greedy(reference, tokens, 16)[0]
    assert [o.token_ids for o in out.outputs] == [expected] * 3


def test_the_engine_counts_a_sequences_states_beside_its_blocks(case):
    """kv_bytes_per_seq: the attention layer's blocks plus the three linear layers' states, whatever the length."""
    llm = like(case, block_size=4)
    engine = llm.engine
    layout = engine.core.kv_layout
    assert layout.state_bytes() == 3 * 4 * (160 * 3 + 4 * 16 * 24)
    assert engine.kv_bytes_per_sequence(1000) - engine.kv_bytes_per_sequence(4) == 249 * engine.core.block_bytes


def test_speculative_decoding_is_refused(case):
    path, _, _ = case
    with pytest.raises(UnsupportedModelError, match="speculative"):
        LLM(str(path), progress=False, speculative_method="ngram", num_speculative_tokens=2)


def test_a_chats_second_turn_reports_cached_tokens_in_the_usage(case):
    """Through the server and the openai client: the second turn (the first's messages, its reply and a new one)
    reports the prompt tokens its state checkpoint served."""
    import openai

    from tests.server.utils import TINY_MODEL, live_server

    path, _, _ = case
    llm = LLM(str(path), progress=False)
    with live_server(llm) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "how does inference work, from the prompt to the last token? " * 3}]
        first = client.chat.completions.create(model=TINY_MODEL, messages=messages, max_tokens=8, temperature=0.0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and the cache?"}]
        second = client.chat.completions.create(model=TINY_MODEL, messages=messages, max_tokens=4, temperature=0.0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16 - 16 and cached > 0 and cached % 16 == 0
