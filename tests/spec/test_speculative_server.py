"""Speculative decoding behind the OpenAI server: same greedy text, and its /metrics counters."""

import httpx

from llmpipe import LLM
from tests.server.utils import live_server, metric

SPEC_COUNTERS = ["llmpipe:spec_decode_num_drafts_total", "llmpipe:spec_decode_num_draft_tokens_total",
                 "llmpipe:spec_decode_num_accepted_tokens_total"]


def test_greedy_completion_and_spec_decode_counters(tiny_checkpoint):
    path = str(tiny_checkpoint("llama_gqa"))
    body = {"prompt": "the quick brown fox jumps over the lazy dog the quick", "max_tokens": 24, "temperature": 0.0,
            "ignore_eos": True}
    texts, counters = [], {}
    for options in ({}, {"speculative_model": path, "speculative_quantization": "int4", "group_size": 32}):
        with live_server(LLM(path, progress=False, **options)) as url:
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            texts.append(reply["choices"][0]["text"])
            if options:
                counters = {name: metric(url, name) for name in SPEC_COUNTERS}
    assert texts[0] == texts[1]
    drafts, proposed, accepted = counters.values()
    assert drafts >= 1 and proposed >= drafts and 0 < accepted <= proposed
    assert accepted + drafts <= 23  # each verification emits its accepted tokens plus one, of the 23 after the first
