"""/v1/completions as lm-evaluation-harness and the OpenAI SDK use it: `echo` with logprobs (the
prompt's tokens first, the first one's logprob null), vLLM's `prompt_logprobs`, several prompts in
one request (choices indexed prompt_index * n + sample_index, usage summed, streamed too), and
/tokenizer_info for lm-eval's remote tokenizer. Logprobs are checked against transformers'
log-softmax on the same weights, texts against transformers' greedy generate and tokenizer."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
import transformers

from llmpipe import LLM
from llmpipe.engine.step_costs import StepCosts
from tests.server.utils import TINY_MODEL, live_server, paced, wait_until

PROMPT = [1, 17, 250, 33, 91, 5, 160, 77, 300, 12, 64, 128, 3, 99, 201, 45]
OTHER = [1, 42, 7, 250, 18, 5, 9]
TOLERANCE = 1e-4
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def url(tiny_llm):
    with live_server(tiny_llm) as url:
        yield url


@pytest.fixture(scope="module")
def reference(tiny_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(tiny_path)


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def greedy(model, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens; min_new_tokens bans EOS as the requests' min_tokens does."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def complete(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"model": TINY_MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream(url: str, **body) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": TINY_MODEL, "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_as_lm_eval_reads_them(url, reference):
    model, tokenizer = reference
    body = complete(url, prompt=[PROMPT], echo=True, logprobs=1, max_tokens=1, temperature=0)  # lm-eval's request
    (choice,) = body["choices"]
    expected = log_softmax(model, PROMPT)
    generated = expected[-1].argmax().item()
    assert choice["text"] == tokenizer.decode(PROMPT, skip_special_tokens=False) + tokenizer.decode([generated])
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(PROMPT) + 1
    assert lp["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in PROMPT + [generated]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for position, token in enumerate(PROMPT[1:] + [generated], start=1):
        row = expected[position - 1]
        assert abs(lp["token_logprobs"][position] - float(row[token])) <= TOLERANCE, position
        best = row.argmax().item()
        top = lp["top_logprobs"][position]
        assert abs(top[tokenizer.decode([best], skip_special_tokens=False)] - float(row[best])) <= TOLERANCE
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert body["usage"]["prompt_tokens"] == len(PROMPT) and body["usage"]["completion_tokens"] == 1


def test_echo_of_a_text_prompt_starts_with_the_prompt_itself(url, reference):
    model, tokenizer = reference
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt)
    body = complete(url, prompt=prompt, echo=True, max_tokens=NEW_TOKENS, temperature=0, min_tokens=NEW_TOKENS)
    assert body["choices"][0]["text"] == prompt + tokenizer.decode(greedy(model, ids))
    assert body["choices"][0]["logprobs"] is None


def test_vllm_prompt_logprobs_ride_on_each_choice(url, reference):
    model, tokenizer = reference
    body = complete(url, prompt=PROMPT, prompt_logprobs=2, max_tokens=2, temperature=0, n=2)
    expected = log_softmax(model, PROMPT)
    for choice in body["choices"]:
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(PROMPT) and entries[0] is None
        for position in range(1, len(PROMPT)):
            row, entry = expected[position - 1], entries[position]
            assert set(entry) == {str(t) for t in row.topk(2).indices.tolist()} | {str(PROMPT[position])}
            for tid, item in entry.items():
                assert abs(item["logprob"] - float(row[int(tid)])) <= TOLERANCE
                assert item["rank"] == int((row > row[int(tid)]).sum()) + 1
                assert item["decoded_token"] == tokenizer.decode([int(tid)], skip_special_tokens=False)
    assert "prompt_logprobs" not in complete(url, prompt=PROMPT, max_tokens=1)["choices"][0]


@pytest.mark.parametrize("as_text", [True, False], ids=["strings", "token-id-lists"])
def test_a_list_of_prompts_gets_choices_indexed_prompt_times_n_plus_sample(url, reference, as_text):
    model, tokenizer = reference
    prompts = [PROMPT, OTHER, PROMPT[:5]]
    sent = [tokenizer.decode(p) for p in prompts] if as_text else prompts
    ids = [tokenizer.encode(p) for p in sent] if as_text else prompts
    body = complete(url, prompt=sent, n=2, max_tokens=NEW_TOKENS, temperature=0, min_tokens=NEW_TOKENS)
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for p, prompt_ids in enumerate(ids):
        expected = tokenizer.decode(greedy(model, prompt_ids))
        assert [body["choices"][p * 2 + i]["text"] for i in range(2)] == [expected, expected]
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert body["usage"]["completion_tokens"] == 6 * NEW_TOKENS
    assert len(body["llmpipe_timing"]) == 3


def test_a_streamed_list_of_prompts_with_echo_adds_up_to_the_whole_reply(url, reference):
    model, tokenizer = reference
    prompts = [PROMPT, OTHER]
    chunks = stream(url, prompt=prompts, n=2, echo=True, logprobs=0, max_tokens=NEW_TOKENS, temperature=0,
                    min_tokens=NEW_TOKENS, stream_options={"include_usage": True})
    texts, tokens, finished, prompt_logprobs = [""] * 4, [[] for _ in range(4)], [None] * 4, [[] for _ in range(4)]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        if "prompt_logprobs" in choice:
            prompt_logprobs[choice["index"]].append(choice["prompt_logprobs"])
        texts[choice["index"]] += choice["text"]
        tokens[choice["index"]] += choice["logprobs"]["token_logprobs"]
        finished[choice["index"]] = finished[choice["index"]] or choice["finish_reason"]
    for p, prompt in enumerate(prompts):
        expected_logprobs = log_softmax(model, prompt)
        for i in range(2):
            index = p * 2 + i
            assert texts[index] == tokenizer.decode(prompt, skip_special_tokens=False) + tokenizer.decode(greedy(model, prompt))
            assert tokens[index][0] is None and len(tokens[index]) == len(prompt) + NEW_TOKENS
            (once,) = prompt_logprobs[index]  # in the choice's first chunk only
            assert once[0] is None and [float(entry[str(t)]["logprob"]) for t, entry in zip(prompt[1:], once[1:])] == \
                tokens[index][1:len(prompt)]
            for position in range(1, len(prompt)):
                assert abs(tokens[index][position] - float(expected_logprobs[position - 1, prompt[position]])) <= TOLERANCE
    assert finished == ["length"] * 4
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens"] == len(PROMPT) + len(OTHER) and usage["completion_tokens"] == 4 * NEW_TOKENS


def test_a_bad_prompt_in_a_list_is_a_400_naming_the_prompt(url):
    response = httpx.post(f"{url}/v1/completions", json={"prompt": [PROMPT, [5, 99999]], "max_tokens": 2}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(url, reference):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    _, tokenizer = reference
    info = httpx.get(f"{url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert isinstance(info["model_max_length"], int)
    base_url = f"{url}/v1/completions"
    assert check_remote_tokenizer_support(base_url)
    remote = RemoteTokenizer(base_url)
    text = "how does inference work? the lazy dog"
    assert remote.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert remote.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    assert remote.eos_token_id == tokenizer.eos_token_id


def test_the_openai_sdk_sends_a_batch_of_prompts_with_echo(url, reference):
    import openai

    model, tokenizer = reference
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = ["the quick brown fox", "how does inference work?"]
    reply = client.completions.create(model=TINY_MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=2,
                                      temperature=0, extra_body={"min_tokens": 2})
    assert [c.index for c in reply.choices] == [0, 1]
    for prompt, choice in zip(prompts, reply.choices):
        ids = tokenizer.encode(prompt)
        assert choice.text == prompt + tokenizer.decode(greedy(model, ids, 2))
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids) + 2
    assert reply.usage.completion_tokens == 4


def test_echo_of_a_truncated_prompt_is_the_text_of_the_tokens_kept(url, reference):
    model, tokenizer = reference
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    body = complete(url, prompt=tokenizer.decode(ids), truncate_prompt_tokens=4, echo=True, max_tokens=2,
                    temperature=0, min_tokens=2)
    kept = ids[-4:]
    expected = tokenizer.decode(kept, skip_special_tokens=False) + tokenizer.decode(greedy(model, kept, 2))
    assert body["choices"][0]["text"] == expected


def test_a_chat_reply_carries_its_prompt_logprobs_once_as_vllm_does(url, reference):
    model, tokenizer = reference
    messages = [{"role": "user", "content": "how does inference work?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    body = {"model": TINY_MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    entries, expected = reply["prompt_logprobs"], log_softmax(model, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for position in range(1, len(ids)):
        item = entries[position][str(ids[position])]
        assert abs(item["logprob"] - float(expected[position - 1, ids[position]])) <= TOLERANCE
    assert all("prompt_logprobs" not in choice for choice in reply["choices"])
    streamed = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


class FixedCosts(StepCosts):
    """Step costs of 10 ms + 1 ms a row, whatever this machine measures: the caps are the same on any machine."""

    def __init__(self, max_stall: float, max_num_seqs: int) -> None:
        super().__init__(max_stall, max_num_seqs)
        self.seconds = {rows: 0.010 + 0.001 * rows for rows in (1, 16, 64, 128, 512, 2048)}

    def observe(self, num_rows: int, seconds: float, decode_only: bool = False) -> None:
        pass


def test_a_list_of_256_prompts_joins_a_stream_at_the_stall_of_a_full_batch(tiny_path):
    """The prompts of one request are sequences as separate requests are, under the same step cap:
    beside a lone stream, a step carries at most max_stall x a decode step of a full batch of prefill
    (before, 127 of these prompts, 1,524 tokens, went into one step) and the stream decodes in every step."""
    # No prefix caching: a prompt sharing its first tokens with one computed in an earlier step would
    # prefill fewer tokens, and which steps those are depends on when the request lands.
    llm = LLM(tiny_path, progress=False, max_decode_stall=2.5, max_num_seqs=128, enable_prefix_caching=False)
    core = llm.engine.core
    core.step_costs = FixedCosts(2.5, 128)
    steps: list[tuple[set[str], int]] = []  # per step: the requests decoding, the prefill tokens
    schedule = core.scheduler.schedule

    def recorded(*budgets):
        out = schedule(*budgets)
        steps.append(({seq.request_id for seq in out.decodes}, sum(item.num_tokens for item in out.prefills)))
        return out

    core.scheduler.schedule = recorded
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 320) for _ in range(11)] for _ in range(256)]
    with live_server(llm, before_step=paced(0.005)) as url:
        body = {"prompt": [1, 5, 9], "max_tokens": 900, "temperature": 0.0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # its first token: it decodes from now on
            listed = httpx.post(f"{url}/v1/completions", json={"prompt": prompts, "max_tokens": 2, "ignore_eos": True},
                                timeout=120)
            assert listed.status_code == 200 and len(listed.json()["choices"]) == 256
        wait_until(lambda: not core.has_unfinished_requests(), "the stream's abort")
    streamer = next(iter(steps[1][0]))
    admitting = [i for i, (_, prefill) in enumerate(steps) if i >= 1 and prefill]  # step 0: the stream's prompt
    cap = core.step_costs.rows_within(2.5 * core.step_costs.cost(128))  # 2.5 x 138 ms: 335 rows
    assert sum(steps[i][1] for i in admitting) == 256 * 12
    for i in range(admitting[0], admitting[-1] + 1):
        decoding, prefill = steps[i]
        assert streamer in decoding, f"step {i}: the stream waited"
        assert prefill + len(decoding) <= cap, f"step {i}: {prefill} prefill tokens beside {len(decoding)} decodes"
