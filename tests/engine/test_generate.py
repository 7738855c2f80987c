"""End-to-end behaviour of LLM.generate / chat / stream on a tiny checkpoint with a real tokenizer."""

import pytest

from llmpipe import LLM, InvalidRequestError, SamplingParams

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("qwen2")), progress=False)


def seeded(llm, **kwargs):
    """A fixed-seed sample: varied text (random tiny models repeat themselves under greedy), yet
    deterministic, so runs that differ only in when they stop share every token before it."""
    params = SamplingParams(temperature=1.0, seed=1234, **{"ignore_eos": True, "max_tokens": 24, **kwargs})
    return llm.generate([PROMPT], params)[0].outputs[0]


def test_max_tokens_ends_with_length(llm):
    out = seeded(llm, max_tokens=7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_string_spanning_tokens_truncates_text_and_is_never_streamed(llm):
    full = seeded(llm)
    tokenizer = llm.get_tokenizer()
    # A stop string that starts inside one token's text and ends inside a later one.
    pieces = [tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    cut = next(i for i in range(2, len(pieces)) if len(pieces[i - 1]) > len(pieces[i - 2]) + 1)
    start = len(pieces[cut - 2]) + 1
    stop = full.text[start : len(pieces[cut - 1]) + 1]
    assert len(stop) >= 2
    first = full.text.find(stop)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True, stop=[stop])
    deltas = list(llm.stream(PROMPT, params))
    out = llm.last_output.outputs[0]
    assert out.text == full.text[:first]
    assert "".join(deltas) == out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop

    included = seeded(llm, stop=[stop], include_stop_str_in_output=True)
    assert included.text == full.text[: first + len(stop)]


def test_stop_token_id_ends_generation_at_that_token(llm):
    full = seeded(llm)
    stop_id = full.token_ids[4]
    out = seeded(llm, stop_token_ids=[stop_id])
    end = full.token_ids.index(stop_id) + 1
    assert out.token_ids == full.token_ids[:end]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_a_stop_token_text_is_left_out_unless_asked_for(llm):
    """vLLM's rule, EOS included (a special token when skip_special_tokens is off, as for Mistral's
    tool calls): the token is in token_ids, its text only with include_stop_str_in_output."""
    full = seeded(llm, skip_special_tokens=False)
    stop_id = full.token_ids[4]
    decode = llm.get_tokenizer().decode
    for include in (False, True):
        out = seeded(llm, stop_token_ids=[stop_id], skip_special_tokens=False, include_stop_str_in_output=include)
        kept = out.token_ids if include else out.token_ids[:-1]
        assert out.token_ids[-1] == stop_id and out.text == decode(kept, skip_special_tokens=False)
    eos = llm.get_tokenizer().eos_token_id
    for include in (False, True):
        out = seeded(llm, ignore_eos=False, logit_bias={eos: 100.0}, skip_special_tokens=False,
                     include_stop_str_in_output=include)
        assert out.token_ids == [eos] and out.finish_reason == "stop"
        assert out.text == (decode([eos], skip_special_tokens=False) if include else "")


def test_min_tokens_holds_back_stop_tokens(llm):
    full = seeded(llm)
    stop_id = full.token_ids[1]
    out = seeded(llm, stop_token_ids=[stop_id], min_tokens=10)
    assert len(out.token_ids) >= 10
    assert stop_id not in out.token_ids[:9]


def test_seeded_sampling_is_reproducible_and_n_samples_differ(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=42, n=3, ignore_eos=True)
    first = llm.generate([PROMPT], params)[0]
    second = llm.generate([PROMPT], params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    assert [o.index for o in first.outputs] == [0, 1, 2]


def test_one_sampling_params_per_prompt_as_vllm_takes_them(llm):
    """Each prompt runs under its own params, batched together: each output equals that prompt's run alone."""
    params = [SamplingParams(temperature=0.0, max_tokens=5), SamplingParams(temperature=1.0, seed=9, max_tokens=7, top_k=20)]
    together = llm.generate([PROMPT, "the lazy dog"], params)
    alone = [llm.generate([prompt], p)[0] for prompt, p in zip([PROMPT, "the lazy dog"], params)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        llm.generate([PROMPT, PROMPT, PROMPT], params)


def test_stream_deltas_join_to_the_final_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    deltas = list(llm.stream(PROMPT, params))
    assert "".join(deltas) == llm.generate([PROMPT], params)[0].outputs[0].text
    assert all(deltas)


def test_outputs_keep_input_order_and_prompt_ids(llm):
    prompts = ["the lazy dog", {"prompt_token_ids": [5, 6, 7, 8]}, "how does inference work?"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))
    assert outs[0].prompt == "the lazy dog"
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("the lazy dog")
    assert outs[1].prompt_token_ids == [5, 6, 7, 8]
    assert outs[2].prompt == "how does inference work?"


def test_logprobs_and_timing_are_recorded_per_token(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 6
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and entry[token].rank == 1 and len(entry) >= 3
    logprobs = [e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)]
    assert completion.cumulative_logprob == pytest.approx(sum(logprobs))
    m = out.metrics
    assert m.ttft > 0 and len(m.token_times) == 6 and len(m.itl) == 5 and m.mean_itl > 0


def test_recompute_without_kv_cache_gives_the_same_tokens(llm, tiny_checkpoint):
    no_cache = LLM(str(tiny_checkpoint("qwen2")), kv_cache=False, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert no_cache.generate([PROMPT], params)[0].outputs[0].token_ids == llm.generate([PROMPT], params)[0].outputs[0].token_ids


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "how does inference work?"}]
    params = SamplingParams(temperature=0.0, max_tokens=5)
    out = llm.chat(messages, params)[0]
    assert out.prompt.startswith("<|im_start|>user\nhow does inference work?<|im_end|>\n<|im_start|>assistant\n")
    assert out.outputs[0].token_ids == llm.generate([out.prompt], params)[0].outputs[0].token_ids


def test_prompt_over_context_limit_is_rejected(tiny_checkpoint):
    small = LLM(str(tiny_checkpoint("qwen2")), max_model_len=16, progress=False)
    with pytest.raises(InvalidRequestError, match="context limit"):
        small.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams())
    out = small.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 16
    assert out.outputs[0].finish_reason == "length"


def test_unknown_engine_option_is_an_error():
    with pytest.raises(TypeError, match="kv_cache_memroy"):
        LLM("unused", kv_cache_memroy=1)


def test_out_of_vocabulary_token_ids_are_rejected(llm):
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [1, 10_000]}], SamplingParams())
