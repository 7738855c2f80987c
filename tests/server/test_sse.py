"""SSE payloads survive clients that split lines at every Unicode line break, and the clients here
split events only where the SSE format ends a line."""

import json

from llmpipe.server.sse import sse_json, sse_lines

BREAKS = "a\nb\rc\x85d\u2028e\u2029f\x1cg\x0bh"


def test_an_event_payload_is_one_line_for_every_line_splitter_and_the_same_json():
    text = sse_json({"text": BREAKS, "n": 1})
    assert len(text.splitlines()) == 1
    assert json.loads(text) == {"text": BREAKS, "n": 1}


def test_client_lines_end_only_at_crlf_lf_or_cr_whatever_the_chunking():
    payload = {"t": "x\u2028y\x85z"}
    stream = "data: " + json.dumps(payload, ensure_ascii=False) + "\r\n\r\ndata: [DONE]\n\n"
    for size in (1, 2, 3, 7, len(stream)):
        lines, buffer = [], ""
        for start in range(0, len(stream), size):
            more, buffer = sse_lines(buffer, stream[start : start + size])
            lines += more
        events = [line for line in lines + [buffer] if line]
        assert events == [stream.split("\r\n")[0], "data: [DONE]"], size
        assert json.loads(events[0][len("data: "):]) == payload
