"""The official openai client against a live server on a tiny checkpoint; transformers is the reference."""

from __future__ import annotations

import openai
import pytest
import tokenizers
import torch
import transformers

from tests.server.utils import TINY_MODEL
from tests.server.references import assert_greedy_matches, hf_greedy, token_ids_of

PROMPT_IDS = [1, 17, 250, 33, 91, 5, 160, 77, 300, 12, 64, 128]
MESSAGES = [{"role": "user", "content": "how does inference work?"}]
IDS_AS_TOKENS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def client(tiny_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_path):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(f"{tiny_path}/tokenizer.json")


def sampled(client, **kwargs):
    options = dict(model=TINY_MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=1.0, seed=7)
    return client.completions.create(**{**options, "extra_body": {"ignore_eos": True}, **kwargs})


def stream_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def test_greedy_completion_matches_transformers_tokens_logprobs_and_text(client, reference, hf_tokenizer):
    out = client.completions.create(
        model=TINY_MODEL, prompt=PROMPT_IDS, max_tokens=16, temperature=0.0, logprobs=3,
        extra_body={"ignore_eos": True, **IDS_AS_TOKENS},
    )
    ref = hf_greedy(reference, PROMPT_IDS, 16)
    choice = out.choices[0]
    ids = token_ids_of(choice.logprobs.tokens)
    assert_greedy_matches(ids, ref)
    assert choice.text == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PROMPT_IDS), 16)
    expected = ref.logprobs[torch.arange(len(ids)), torch.tensor(ids)]
    torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs), expected, atol=1e-4, rtol=0)
    for step, top in enumerate(choice.logprobs.top_logprobs):
        want = ref.logprobs[step].topk(3)
        got = sorted(top.values(), reverse=True)
        torch.testing.assert_close(torch.tensor(got), want.values, atol=1e-4, rtol=0)
    assert out.model_extra["llmpipe_timing"]["output_tokens"] == 16


def test_chat_applies_the_template_like_transformers(client, reference, tiny_path):
    prompt_ids = transformers.AutoTokenizer.from_pretrained(tiny_path).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    out = client.chat.completions.create(
        model=TINY_MODEL, messages=MESSAGES, max_tokens=10, temperature=0.0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, **IDS_AS_TOKENS},
    )
    assert out.usage.prompt_tokens == len(prompt_ids)
    content = out.choices[0].logprobs.content
    assert_greedy_matches(token_ids_of([item.token for item in content]), hf_greedy(reference, prompt_ids, 10))
    assert all(len(item.top_logprobs) == 2 for item in content)
    assert out.choices[0].message.role == "assistant"


def test_streamed_completion_equals_non_streamed_for_the_same_seed(client):
    whole = sampled(client)
    text, chunks = stream_text(sampled(client, stream=True))
    assert text == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["llmpipe_timing"]["output_tokens"] == 12


def test_streamed_chat_equals_non_streamed_and_reports_usage_last(client):
    options = dict(model=TINY_MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=3,
                   extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **options))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].model_extra["llmpipe_timing"]["ttft_s"] > 0


def test_seed_reproduces_and_another_seed_differs(client):
    texts = [sampled(client, seed=seed).choices[0].text for seed in (11, 11, 12)]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_stop_string_cuts_the_text_before_it(client, reference, hf_tokenizer):
    full = hf_tokenizer.decode(hf_greedy(reference, PROMPT_IDS, 24).token_ids, skip_special_tokens=True)
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if full.find(full[i : i + 2]) >= 3)
    options = dict(model=TINY_MODEL, prompt=PROMPT_IDS, max_tokens=24, temperature=0.0, stop=[stop],
                   extra_body={"ignore_eos": True})
    out = client.completions.create(**options)
    assert out.choices[0].text == full[: full.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    text, _ = stream_text(client.completions.create(stream=True, **options))
    assert text == out.choices[0].text


def test_n_greater_than_one_returns_n_choices(client, reference):
    greedy = client.completions.create(
        model=TINY_MODEL, prompt=PROMPT_IDS, max_tokens=8, temperature=0.0, n=2, logprobs=0,
        extra_body={"ignore_eos": True, **IDS_AS_TOKENS},
    )
    ref = hf_greedy(reference, PROMPT_IDS, 8)
    assert [c.index for c in greedy.choices] == [0, 1]
    for choice in greedy.choices:
        assert_greedy_matches(token_ids_of(choice.logprobs.tokens), ref)
    many = sampled(client, n=3)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert len({c.text for c in many.choices}) == 3
    assert many.usage.completion_tokens == 3 * 12
    streamed = {}
    for chunk in sampled(client, n=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in many.choices}


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [TINY_MODEL]


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)


def test_chat_logprob_bytes_are_each_tokens_own(client, hf_tokenizer):
    """A token that is part of a UTF-8 sequence carries its own bytes, not U+FFFD's: the tokens' bytes
    rebuild the reply exactly as the tokenizer decodes it."""
    out = client.chat.completions.create(
        model=TINY_MODEL, messages=MESSAGES, max_tokens=24, temperature=1.0, seed=3, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, **IDS_AS_TOKENS},
    )
    content = out.choices[0].logprobs.content
    ids = token_ids_of([item.token for item in content])
    for item, token_id in zip(content, ids):
        raw = bytes(item.bytes)
        ref = hf_tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in ref:
            assert raw.decode("utf-8") == ref
    joined = b"".join(bytes(item.bytes) for item in content)
    assert joined.decode("utf-8", errors="replace") == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert out.choices[0].message.content == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(client):
    prompt = [1, *range(20, 120)]  # 101 tokens: several whole blocks to reuse
    first = client.completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
    again = client.completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < len(prompt) and cached % 16 == 0  # whole blocks (block_size 16), never the last token
