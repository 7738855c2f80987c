"""`llmpipe bench embeddings` against a live tiny server: a stream alone and beside embedding clients."""

import json

from llmpipe import LLM
from llmpipe.bench.embed_stall import run_embed_stall
from tests.server.utils import TINY_MODEL, live_server


def test_it_reports_the_streams_latencies_and_the_embeddings_served(tiny_checkpoint, tmp_path):
    llm = LLM(str(tiny_checkpoint("llama_gqa")), progress=False, max_decode_stall=2.5)
    output = tmp_path / "embeddings.json"
    with live_server(llm) as url:
        result = run_embed_stall(url, None, clients=2, words=12, max_tokens=12, rounds=1, output=str(output), alone_s=0.5)
    assert json.loads(output.read_text()) == result
    assert result["model"] == TINY_MODEL and result["embeddings_failed"] == 0
    assert len(result["ttft_alone_ms"]) == len(result["ttft_beside_embeddings_ms"]) == 1
    for phase in ("itl_alone_ms", "itl_beside_embeddings_ms"):
        assert 0 < result[phase]["p50"] <= result[phase]["p99"]
    assert result["itl_p99_ratio"] > 0 and result["embeddings_per_s_without_stream"] >= 0
