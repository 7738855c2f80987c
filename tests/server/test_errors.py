"""Bad input gets a 4xx with an OpenAI-style error naming what was wrong; server faults stay contained."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi.routing import APIRoute

from llmpipe import LLM
from llmpipe.engine.stop_rules import StopRules
from llmpipe.server.app import router
from llmpipe.server.input_processor import MAX_JSON_DEPTH, InputProcessor
from llmpipe.server.protocol import REQUESTS
from tests.server.utils import TINY_MODEL, live_server, metric, paced

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url(tiny_llm):
    with live_server(tiny_llm, api_key=KEY, max_body_bytes=MAX_BODY) as url:
        yield url


def post(url: str, path: str, payload=None, *, content: bytes | None = None, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=payload, content=content, headers=headers, timeout=60)


# (route, body, status, param, words the message must contain)
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", [">= 0"]),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", ["(0, 1]"]),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p", ["[0, 1]"]),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", ["[-2, 2]"]),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", ["> 0"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", [">= 1"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", ["<= max_tokens"]),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", ["greater than or equal to 1"]),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n", ["less than or equal to 16"]),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", ["less than or equal to 20"]),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed", ["less than or equal to"]),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", ["valid number"]),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop", ["[0]", "1 to 256 characters"]),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", ["Field required"]),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", ["empty"]),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt", ["[0, 320)"]),
    ("/v1/completions", {"prompt": ["a"] * 257}, 400, "prompt", ["at most 256 prompts", "got 257"]),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt", ["empty"]),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs", ["less than or equal to 20"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1024}, 400, "max_tokens", ["max_tokens (1024)", "max_model_len (1024)"]),
    ("/v1/completions", {"prompt": list(range(5, 300)) * 4}, 400, "max_tokens", ["max_model_len"]),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", ["gpt-4", "does not exist"]),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", ["at least 1"]),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", ["'user'"]),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs", ["20"]),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5000}, 400, "max_tokens", ["max_model_len (1024)"]),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model", ["nope"]),
    ("/v1/chat/completions", {"messages": [*CHAT, {"role": "tool", "content": "sunny"}]}, 400, "messages[1].tool_call_id",
     ["messages[1].tool_call_id: required"]),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt", ["exactly one of prompt or messages"]),
    ("/detokenize", {"tokens": [5, 400]}, 400, "tokens", ["tokens must be ids in [0, ", "got 400"]),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]", ["greater than or equal to 0"]),
]


@pytest.mark.parametrize("route,payload,status,param,words", BAD_REQUESTS, ids=[str(b[1])[:40] for b in BAD_REQUESTS])
def test_bad_request_gets_its_status_and_an_openai_error_naming_the_field(url, route, payload, status, param, words):
    response = post(url, route, payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and isinstance(error["code"], str)
    assert error["param"] == param
    for word in words:
        assert word in error["message"]


def test_malformed_json_is_400(url):
    response = post(url, "/v1/completions", content=b'{"prompt": "hi",', headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400
    assert "malformed JSON" in response.json()["error"]["message"]


def nested(depth: int, shape: str) -> str:
    """JSON `depth` levels deep: arrays in arrays, or objects in objects."""
    return "[" * depth + "]" * depth if shape == "list" else '{"x":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("shape", ["list", "object"])
@pytest.mark.parametrize("route", list(REQUESTS))
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 10_000])
def test_a_body_nested_past_the_depth_cap_is_400_on_every_route(url, route, shape, depth):
    content = f'{{"messages": {nested(depth, shape)}}}'.encode()
    response = post(url, route, content=content, headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_json" and f"more than {MAX_JSON_DEPTH} levels" in error["message"]


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


# Free-form fields that the chat template, pydantic or llguidance walk over, at the depth cap.
AT_THE_CAP = {
    "chat_template_kwargs": {"chat_template_kwargs": {"x": json.loads(nested(MAX_JSON_DEPTH - 2, "object"))}},
    "response_format": {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "deep", "schema": deep_schema(MAX_JSON_DEPTH - 4)}}},
    "guided_json": {"guided_json": deep_schema(MAX_JSON_DEPTH - 2)},
    "tools": {"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": deep_schema(MAX_JSON_DEPTH - 7)}}}}]},
}


@pytest.mark.parametrize("field", list(AT_THE_CAP))
def test_a_body_at_the_depth_cap_is_served_or_refused_but_never_fails(url, field):
    response = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **AT_THE_CAP[field]})
    assert response.status_code in (200, 400), response.text


def test_a_recursion_error_anywhere_in_a_request_is_a_400(url, monkeypatch):
    def too_deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(InputProcessor, "chat_prompt", too_deep)
    response = post(url, "/v1/chat/completions", {"messages": CHAT})
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"]


@pytest.mark.parametrize("route", [r for r in router.routes if isinstance(r, APIRoute)], ids=lambda r: r.path)
def test_405_says_which_methods_the_route_allows(url, route):
    wrong = "POST" if "POST" not in route.methods else "GET"
    response = httpx.request(wrong, f"{url}{route.path}", headers=AUTH)
    assert response.status_code == 405
    assert set(response.headers["Allow"].split(", ")) == route.methods
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_oversized_body_is_413_with_or_without_content_length(url):
    big = {"prompt": "x" * (MAX_BODY + 1)}
    assert post(url, "/v1/completions", big).status_code == 413
    chunks = (b"x" * 8192 for _ in range(MAX_BODY // 8192 + 2))  # chunked: no Content-Length
    response = httpx.post(f"{url}/v1/completions", content=chunks, headers=AUTH)
    assert response.status_code == 413 and "over the limit" in response.json()["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_missing_or_wrong_api_key_is_401(url, headers):
    for path in ("/v1/models", "/metrics"):
        response = httpx.get(f"{url}{path}", headers=headers)
        assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
    assert post(url, "/v1/completions", {"prompt": "hi"}, headers=headers).status_code == 401


def test_health_and_playground_need_no_key(url):
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/").status_code == 200
    assert httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"] == TINY_MODEL


def wait_for(url: str, name: str, value: float) -> None:
    deadline = time.monotonic() + 120  # a hang guard
    while metric(url, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def test_full_waiting_queue_is_503(tiny_path):
    """max_num_seqs=1 and max_waiting=1: one request runs, one waits, the third is turned away."""
    long = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True, "temperature": 0.0, "stream": True}
    llm = LLM(tiny_path, progress=False, max_num_seqs=1)  # paced: the running request lasts 50 s
    with live_server(llm, max_waiting=1, before_step=paced()) as url, httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/completions", json=long) as running:
            wait_for(url, "llmpipe:num_requests_running", 1)
            with client.stream("POST", f"{url}/v1/completions", json=long) as waiting:
                assert running.status_code == waiting.status_code == 200
                wait_for(url, "llmpipe:num_requests_waiting", 1)
                refused = client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503
    assert "waiting queue is full" in refused.json()["error"]["message"]


def test_a_fault_in_one_request_fails_only_that_request(url, tiny_llm, monkeypatch):
    """A request whose token handling raises gets an error; one running beside it completes."""
    poison = 311
    original = StopRules.append

    def faulty(self, seq, token):
        if seq.prompt_token_ids[-1] == poison and len(seq.output_token_ids) == 3:
            raise RuntimeError("injected fault")
        return original(self, seq, token)

    monkeypatch.setattr(StopRules, "append", faulty)
    healthy = {"prompt": [1, 5, 9], "max_tokens": 40, "ignore_eos": True, "temperature": 0.0}
    results = {}

    def call(name, payload):
        results[name] = post(url, "/v1/completions", payload)

    threads = [threading.Thread(target=call, args=("healthy", healthy))]
    threads.append(threading.Thread(target=call, args=("poisoned", {**healthy, "prompt": [1, 5, poison]})))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["healthy"].status_code == 200
    assert results["healthy"].json()["usage"]["completion_tokens"] == 40
    assert results["poisoned"].status_code == 500
    assert "failed" in results["poisoned"].json()["error"]["message"]
    streamed = httpx.post(f"{url}/v1/completions", json={**healthy, "prompt": [1, 5, poison], "stream": True}, headers=AUTH)
    assert '"error"' in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    assert metric(url, "llmpipe:kv_cache_usage_perc", AUTH) == 0.0
    assert post(url, "/v1/completions", healthy).status_code == 200


def test_an_out_of_vocabulary_stop_id_is_a_400_and_the_batch_beside_it_goes_on(url):
    """Issue row 1: with min_tokens the id used to reach the sampler and fail every request in the batch."""
    healthy = {"prompt": [1, 5, 9], "max_tokens": 40, "ignore_eos": True, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}}
    events = []

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", json=healthy, headers=AUTH, timeout=60) as response:
            events.extend(line for line in response.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=stream)
    thread.start()
    for stop_id in (10**9, -(10**9)):
        bad = {"prompt": "x", "max_tokens": 3, "min_tokens": 1, "stop_token_ids": [stop_id]}
        response = post(url, "/v1/completions", bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == "stop_token_ids"
        assert "index" not in response.text  # no torch internals
    thread.join(timeout=120)
    assert events[-1] == "data: [DONE]" and '"error"' not in "".join(events)
    assert json.loads(events[-2][len("data: "):])["usage"]["completion_tokens"] == 40


def test_a_failed_model_step_fails_its_requests_with_a_clear_message_and_the_server_goes_on(tiny_path):
    llm = LLM(tiny_path, progress=False)
    runner, calls = llm.engine.core.runner, []
    original = runner.execute

    def failing_once(batch):
        calls.append(batch)
        if len(calls) == 2:  # the second step: a request is mid-decode
            raise RuntimeError("injected forward fault")
        return original(batch)

    runner.execute = failing_once
    body = {"prompt": [1, 5, 9], "max_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    with live_server(llm) as url:
        failed = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "server_error" and "step failed (RuntimeError)" in error["message"]
        assert "injected" not in error["message"]  # the details go to the log, not to the client
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 8
        assert metric(url, "llmpipe:kv_cache_usage_perc") == 0.0
