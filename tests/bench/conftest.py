import pytest

from llmpipe import LLM
from tests.server.utils import live_server


@pytest.fixture(scope="module")
def url(tiny_checkpoint):
    """A live server of the tiny checkpoint, for the benchmarks that load-test one."""
    with live_server(LLM(str(tiny_checkpoint("llama_gqa")), progress=False)) as url:
        yield url
