"""StopStringMatcher on arbitrary chunkings of text, against str.find over the text seen so far."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmpipe.tokenizer.stop_strings import StopStringMatcher

ALPHABET = st.sampled_from("abcab é🎉\n")


def reference(chunks: list[str], stops: list[str], include: bool) -> tuple[str, str | None]:
    """After each chunk, look for the earliest-starting stop (first listed on a tie) in all text so far."""
    text = ""
    for chunk in chunks:
        text += chunk
        found = [(text.find(stop), order, stop) for order, stop in enumerate(stops) if stop and stop in text]
        if found:
            start, _, stop = min(found)
            return text[: start + (len(stop) if include else 0)], stop
    return text, None


@settings(max_examples=500, deadline=None)
@given(
    chunks=st.lists(st.text(ALPHABET, max_size=4), max_size=12),
    stops=st.lists(st.text(ALPHABET, max_size=4), max_size=3),
    include=st.booleans(),
)
def test_output_is_text_up_to_the_first_completed_stop(chunks, stops, include):
    matcher = StopStringMatcher(stops, include_stop=include)
    output = ""
    for chunk in chunks:
        output += matcher.push(chunk)
    if matcher.matched is None:
        output += matcher.flush()
    assert (output, matcher.matched) == reference(chunks, stops, include)


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(st.text(ALPHABET, max_size=4), max_size=12), stops=st.lists(st.text(ALPHABET, min_size=1,
                                                                                            max_size=4), min_size=1))
def test_output_lags_input_by_less_than_the_longest_stop(chunks, stops):
    matcher = StopStringMatcher(stops)
    seen = output = ""
    for chunk in chunks:
        seen += chunk
        output += matcher.push(chunk)
        if matcher.matched is not None:
            break
        assert seen.startswith(output)
        assert len(seen) - len(output) < max(map(len, stops))


def test_nothing_is_emitted_after_a_match():
    matcher = StopStringMatcher(["END"])
    assert matcher.push("doneEN") == "done"
    assert matcher.push("D and more") == ""
    assert matcher.matched == "END"
    assert matcher.push("again") == "" and matcher.flush() == ""
