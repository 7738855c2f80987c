"""Live servers on loopback: uvicorn in a background thread, on a port the OS picks."""

from __future__ import annotations

from typing import Iterator

import pytest

from llmpipe import LLM
from tests.server.utils import live_server


@pytest.fixture(scope="session")
def tiny_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama_gqa"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_path) -> LLM:
    """Shared by the test modules' servers, one server at a time."""
    return LLM(tiny_path, progress=False)


@pytest.fixture(scope="module")
def tiny_url(tiny_llm) -> Iterator[str]:
    with live_server(tiny_llm) as url:
        yield url
