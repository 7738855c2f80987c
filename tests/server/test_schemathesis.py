"""Schemathesis: requests generated from the server's own OpenAPI schema, valid and invalid, never get a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from llmpipe import LLM
from tests.server.utils import live_server

OPERATIONS = {  # label → examples per generation mode
    "POST /v1/completions": 40,
    "POST /v1/chat/completions": 40,
    "POST /v1/responses": 30,
    "POST /v1/messages": 30,
    "POST /v1/messages/count_tokens": 10,
    "POST /v1/embeddings": 30,
    "POST /v1/rerank": 15,
    "POST /v1/score": 15,
    "POST /tokenize": 15,
    "POST /detokenize": 15,
    "GET /v1/models": 1,
    "POST /v1/load_lora_adapter": 10,  # a server without --enable-lora: every one a 400
    "POST /v1/unload_lora_adapter": 10,
    "GET /health": 1,
    "GET /metrics": 1,
    "GET /tokenizer_info": 1,
}


@pytest.fixture(scope="module")
def base_url(tiny_path):
    # A short context keeps every generated request quick.
    with live_server(LLM(tiny_path, progress=False, max_model_len=48)) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(base_url):
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


def test_the_schema_lists_every_route(api_schema):
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS)


@pytest.mark.parametrize("label", OPERATIONS)
def test_no_generated_request_gets_a_server_error(api_schema, base_url, label):
    operation = api_schema.find_operation_by_label(label)
    strategy = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in GenerationMode))

    @given(case=strategy)
    @settings(max_examples=2 * OPERATIONS[label], deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        case.call_and_validate(base_url=base_url, checks=[not_a_server_error], timeout=60)

    check()
