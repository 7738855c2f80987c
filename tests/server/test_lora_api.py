"""LoRA adapters over HTTP: a request's `model` picks an adapter (completions, chat, responses, messages),
/v1/models lists them, /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time (behind the
API key), with vLLM's statuses; in-process and over an engine core process."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

from llmpipe import LLM
from tests.lora.helpers import hf_model, save_peft_adapter
from tests.server.utils import TINY_MODEL, core_process_engine, live_server, paced

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [1, 17, 250, 33, 91, 5, 160]
TOKENS = 6


@pytest.fixture(scope="module")
def lora_setup(tiny_path, tmp_path_factory):
    """(transformers base model, adapters: name → directory); "big" has a rank above the servers' max."""
    base = hf_model(tiny_path)
    root = tmp_path_factory.mktemp("server_adapters")
    adapters = {name: save_peft_adapter(base, root / name, seed=seed, r=r, alpha=2 * r)
                for name, seed, r in (("sql", 21, 8), ("poet", 22, 4), ("extra", 23, 4), ("big", 24, 16))}
    return base, adapters


@pytest.fixture(scope="module")
def url(tiny_path, lora_setup):
    _, adapters = lora_setup
    llm = LLM(tiny_path, dtype="float32", max_lora_rank=8, max_loras=3, lora_modules=[f"sql={adapters['sql']}"],
              progress=False)
    with live_server(llm, api_key=KEY) as base_url:
        yield base_url
    llm.close()


def greedy(base, adapter_dir, prompt: list[int], n: int) -> list[int]:
    """PEFT's merged model's greedy continuation (the base model's where adapter_dir is None)."""
    from peft import PeftModel

    model = base if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).merge_and_unload()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def complete(url: str, model: str, **fields) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "logprobs": 0, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)


def token_ids(reply: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]


def test_models_lists_the_adapters_loaded_at_start(url, lora_setup):
    data = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
    assert [card["id"] for card in data] == [TINY_MODEL, "sql"]
    assert data[1]["parent"] == TINY_MODEL and data[1]["root"] == str(lora_setup[1]["sql"])


def test_a_request_naming_an_adapter_runs_under_it(url, lora_setup):
    base, adapters = lora_setup
    reply = complete(url, "sql")
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "sql"
    assert token_ids(reply.json()) == greedy(base, adapters["sql"], PROMPT, TOKENS)
    assert token_ids(complete(url, TINY_MODEL).json()) == greedy(base, None, PROMPT, TOKENS)


def test_chat_responses_and_messages_take_an_adapter_as_their_model(url):
    chat = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(f"{url}/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == "sql", reply.text
    reply = httpx.post(f"{url}/v1/responses", json={"model": "sql", "input": "hi", "max_output_tokens": 2}, headers=AUTH,
                       timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == "sql", reply.text
    messages = {"model": "sql", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(f"{url}/v1/messages", json=messages, headers=AUTH, timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == "sql", reply.text


def test_an_unknown_model_is_a_404(url):
    reply = complete(url, "nobody")
    assert reply.status_code == 404
    assert "the model 'nobody' does not exist" in reply.json()["error"]["message"]


def test_adapters_load_and_unload_at_run_time(url, lora_setup):
    base, adapters = lora_setup
    load = {"lora_name": "poet", "lora_path": str(adapters["poet"])}
    reply = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    assert "poet" in [card["id"] for card in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]]
    assert token_ids(complete(url, "poet").json()) == greedy(base, adapters["poet"], PROMPT, TOKENS)
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=AUTH, timeout=60)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    reply = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poet"}, headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    assert complete(url, "poet").status_code == 404
    reply = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poet"}, headers=AUTH, timeout=60)
    assert reply.status_code == 404


@pytest.mark.parametrize("name,path,message", [
    ("big", "big", "max_lora_rank"),
    ("nowhere", None, "no such LoRA adapter"),
    (TINY_MODEL, "extra", "base model's name"),
])
def test_an_adapter_that_cannot_load_is_a_400(url, lora_setup, name, path, message):
    adapters = lora_setup[1]
    body = {"lora_name": name, "lora_path": str(adapters[path]) if path else "/no/such/adapter"}
    reply = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)
    assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text


def test_the_lora_routes_need_the_api_key(url, lora_setup):
    body = {"lora_name": "extra", "lora_path": str(lora_setup[1]["extra"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=60).status_code == 401


def test_an_adapter_is_refused_on_a_server_without_lora(tiny_url):
    reply = httpx.post(f"{tiny_url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}, timeout=60)
    assert reply.status_code == 400 and "--enable-lora" in reply.json()["error"]["message"]


def test_adapters_load_across_an_engine_core_process(tiny_path, lora_setup):
    base, adapters = lora_setup
    engine = core_process_engine(tiny_path, dtype="float32", enable_lora=True, max_lora_rank=8)
    with live_server(engine) as base_url:
        load = {"lora_name": "poet", "lora_path": str(adapters["poet"])}
        assert httpx.post(f"{base_url}/v1/load_lora_adapter", json=load, timeout=120).status_code == 200
        reply = complete(base_url, "poet")
        assert reply.status_code == 200, reply.text
        assert token_ids(reply.json()) == greedy(base, adapters["poet"], PROMPT, TOKENS)
        big = {"lora_name": "big", "lora_path": str(adapters["big"])}
        reply = httpx.post(f"{base_url}/v1/load_lora_adapter", json=big, timeout=120)
        assert reply.status_code == 400 and "max_lora_rank" in reply.text
        assert httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "poet"}, timeout=120).status_code == 200
        assert httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "poet"}, timeout=120).status_code == 404


def test_streams_keep_decoding_while_an_adapter_file_is_read(tiny_path, lora_setup, monkeypatch):
    """A load's file is read off the step (CoreLoop): a stream in flight gets tokens meanwhile, and the
    adapter serves once the read finishes."""
    import threading

    from llmpipe.lora.served import ServedAdapters

    _, adapters = lora_setup
    reading, release = threading.Event(), threading.Event()
    original = ServedAdapters.read

    def slow_read(self, name, path):
        reading.set()
        assert release.wait(60), "the test never released the read"
        return original(self, name, path)

    monkeypatch.setattr(ServedAdapters, "read", slow_read)
    llm = LLM(tiny_path, dtype="float32", enable_lora=True, max_lora_rank=8, progress=False)
    body = {"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with live_server(llm, api_key=KEY, before_step=paced()) as url, httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            load = threading.Thread(target=lambda: client.post(
                f"{url}/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(adapters["poet"])}, headers=AUTH))
            load.start()
            assert reading.wait(60)
            chunks = [next(line for line in lines if line.startswith("data:")) for _ in range(5)]  # the read still waits
            assert all("[DONE]" not in chunk for chunk in chunks) and not release.is_set()
            release.set()
            load.join(60)
        assert complete(url, "poet").status_code == 200
    llm.close()
