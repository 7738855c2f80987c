"""`llmpipe bench robustness` against a live tiny server: its probes report what they measured."""

from llmpipe import LLM
from llmpipe.bench.robustness import probe, stalled_headers
from tests.server.utils import live_server, paced


def test_a_probe_reports_the_answer_health_polls_and_stream_gaps(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama_gqa")), progress=False)
    with live_server(llm, header_timeout=1.0, before_step=paced()) as url:  # the stream outlasts the probe
        result = probe(url, "70,000 stop strings", {}, None)
        closed, _ = stalled_headers(url, connections=3, wait_s=60)
    assert result.status == 400 and result.answer_s > 0
    assert result.health_polls >= 1 and result.health_worst_s > 0
    assert result.gap_quiet_s > 0 and 0 < result.gap_during_s <= result.gap_worst_s
    assert closed == 3
