"""The real SmolLM2-135M-Instruct behind the server, through the openai client: greedy chat equals
transformers' greedy decoding of the same template, a stop string ends the first sentence."""

from __future__ import annotations

import openai
import pytest
import torch

from llmpipe import LLM
from llmpipe.bench.hf_baseline import load_transformers_model
from tests.server.utils import live_server
from tests.server.references import assert_greedy_matches, hf_greedy, token_ids_of

pytestmark = pytest.mark.slow
NEAR_TIE = 0.01  # quantized weights dequantized by two different codes: as in the model parity test
MESSAGES = [{"role": "user", "content": "Explain what a KV cache is."}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    llm = LLM("smollm2-135m-instruct", progress=False)
    with live_server(llm, model_name="smollm2") as url:
        yield llm, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(served, smollm2_gguf):
    llm, _ = served
    prompt_ids = llm.chat_prompt(MESSAGES)["prompt_token_ids"]
    model = load_transformers_model(smollm2_gguf, torch.float32)
    return prompt_ids, hf_greedy(model, prompt_ids, 2 * MAX_TOKENS)


def test_greedy_chat_matches_transformers_streamed_or_not(served, reference):
    llm, client = served
    prompt_ids, ref = reference
    options = dict(model="smollm2", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0)
    whole = client.chat.completions.create(logprobs=True, extra_body={"return_tokens_as_token_ids": True}, **options)
    ids = token_ids_of([item.token for item in whole.choices[0].logprobs.content])
    ref.token_ids = ref.token_ids[:MAX_TOKENS]
    assert_greedy_matches(ids, ref, NEAR_TIE)
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.choices[0].finish_reason == "length"
    streamed = client.chat.completions.create(stream=True, **options)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.choices[0].message.content
    assert whole.choices[0].message.content == llm.get_tokenizer().decode(ids)


def test_stop_string_ends_the_first_sentence(served, reference):
    llm, client = served
    _, ref = reference
    text = llm.get_tokenizer().decode(ref.token_ids)
    assert ". " in text, text
    out = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=2 * MAX_TOKENS, temperature=0.0, stop=[". "]
    )
    assert out.choices[0].message.content == text[: text.index(". ")]
    assert out.choices[0].finish_reason == "stop"
