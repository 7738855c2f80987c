"""A property test: valid request bodies with random mutations (wrong types, huge values, bad Unicode,
unknown fields) never get a 5xx, always get JSON (or a well-formed stream), and leave the server healthy."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmpipe import LLM
from llmpipe.server.protocol import REQUESTS
from tests.server.utils import live_server

CHAT = [{"role": "user", "content": "hi"}]
BASES = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6]},
}
BAD_TEXT = st.sampled_from(["\udfff", "a\ud800b", "\x00", "💥" * 50, "", " " * 300, "\u202e", "null", "-1"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | BAD_TEXT
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8
)

BAD_VALUES = (  # bad text where text is expected: alone, in a list, as a chat message's content
    BAD_TEXT
    | st.lists(BAD_TEXT, min_size=1, max_size=3)
    | st.builds(lambda text, role: [{"role": role, "content": text}], BAD_TEXT, st.sampled_from(["user", "system"]))
)


@st.composite
def mutated_request(draw) -> tuple[str, dict]:
    route = draw(st.sampled_from(sorted(BASES)))
    body = dict(BASES[route])
    fields = sorted(REQUESTS[route].model_fields) + ["unknown_field"]
    for _ in range(draw(st.integers(1, 3))):
        # half the time a field the base request uses (prompt, messages, tokens), where text is parsed
        field = draw(st.sampled_from(sorted(body)) | st.sampled_from(fields))
        body[field] = draw(BAD_VALUES | VALUES)
    return route, body


@pytest.fixture(scope="module")
def base_url(tiny_path):
    with live_server(LLM(tiny_path, progress=False, max_model_len=48)) as url:
        yield url


def test_mutated_bodies_never_get_a_server_error_and_the_server_stays_healthy(base_url):
    @given(request=mutated_request())
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(request):
        route, body = request
        content = json.dumps(body, allow_nan=True).encode()
        response = httpx.post(
            f"{base_url}{route}", content=content, headers={"Content-Type": "application/json"}, timeout=60
        )
        assert response.status_code < 500, (body, response.text)
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n")
        else:
            reply = response.json()
            if response.status_code >= 400:
                assert set(reply["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(f"{base_url}/health", timeout=60).status_code == 200

    check()
