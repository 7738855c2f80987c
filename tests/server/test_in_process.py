"""An LLM served in its own process (create_app over an in-process LLM: its core steps on a thread) takes no
requests of its own while the server runs: they would race the server's thread for the core and its outputs."""

from __future__ import annotations

import httpx
import pytest

from llmpipe import LLM, SamplingParams
from llmpipe.errors import LLMPipeError
from tests.server.utils import TINY_MODEL, live_server

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_a_served_llm_refuses_its_own_requests_until_the_server_stops(tiny_path):
    llm = LLM(tiny_path, progress=False)
    before = llm.generate(["the quick"], GREEDY, use_tqdm=False)[0].outputs[0].text
    with live_server(llm) as url:
        with pytest.raises(LLMPipeError, match="served by an API server"):
            llm.generate(["the quick"], GREEDY, use_tqdm=False)
        body = {"model": TINY_MODEL, "prompt": "the quick", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == before
    assert llm.generate(["the quick"], GREEDY, use_tqdm=False)[0].outputs[0].text == before
