"""Each tool-call parser on text in its model's own format: whole, malformed, and streamed split at
every character boundary (the deltas must reassemble to what the whole text gives)."""

from __future__ import annotations

import json

import pytest

from llmpipe.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    get_tool_parser,
    parse_tool_calls,
    parser_for_template,
)
from llmpipe.tool_parsers.json_calls import value_end

PARIS = {"location": "Paris, France", "unit": "celsius"}
NESTED = {"query": "brace } and \"quote\" and [bracket]", "filters": {"tags": ["a", "b"], "limit": 3}, "ok": True}
UNICODE = {"city": "Zürich 東京", "note": "tab\tnew\nline \\ slash"}


def qwen_call(name: str, arguments: dict) -> str:
    """A call as Qwen 2.5 / 3 write it (their templates teach this exact layout)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


def llama_call(name: str, arguments: dict) -> str:
    return f'{{"name": "{name}", "parameters": {json.dumps(arguments, ensure_ascii=False)}}}'


def mistral_array(*calls: tuple[str, dict]) -> str:
    return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


# (parser, text, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", qwen_call("get_weather", PARIS), None, [("get_weather", PARIS)]),
    ("hermes", "Let me check.\n\n" + qwen_call("get_weather", PARIS), "Let me check.", [("get_weather", PARIS)]),
    ("hermes", qwen_call("get_weather", PARIS) + "\n" + qwen_call("search", NESTED) + "\n" + qwen_call("t", UNICODE),
     None, [("get_weather", PARIS), ("search", NESTED), ("t", UNICODE)]),
    ("hermes", "no tools needed: <tool_call is not a tag", "no tools needed: <tool_call is not a tag", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {}}', None, [("get_weather", {})]),  # EOS, no close
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}, "name": "swap"}\n</tool_call>', None, [("swap", {"a": 1})]),
    ("llama3_json", llama_call("get_weather", PARIS), None, [("get_weather", PARIS)]),
    ("llama3_json", "<|python_tag|>" + llama_call("search", NESTED), None, [("search", NESTED)]),
    ("llama3_json", llama_call("a", PARIS) + "; " + llama_call("b", UNICODE), None, [("a", PARIS), ("b", UNICODE)]),
    ("llama3_json", '{"name": "f", "arguments": {"x": [1, 2]}}', None, [("f", {"x": [1, 2]})]),
    ("llama3_json", '{"type": "function", "name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),  # 3.2 does
    ("llama3_json", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("mistral", mistral_array(("get_weather", PARIS)), None, [("get_weather", PARIS)]),
    ("mistral", "Sure. " + mistral_array(("a", NESTED), ("b", UNICODE)), "Sure.", [("a", NESTED), ("b", UNICODE)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}[TOOL_CALLS]t[ARGS]{"x": 1}', None,
     [("get_weather", {"location": "Paris"}), ("t", {"x": 1})]),
    ("mistral", "Plain [TOOL answer.", "Plain [TOOL answer.", []),
]
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": }}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}\n</tool_call>'),  # one } short
    ("hermes", "<tool_call>\nnot json at all\n</tool_call>"),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}} trailing\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"location": "Paris"'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", llama_call("a", PARIS) + " and then some words"),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": tru}}]'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}'),
    ("mistral", "[TOOL_CALLS]f[ARGS]{oops}"),
]


def parsed(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_text(name, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, get_tool_parser(name))
    assert got_content == content
    assert parsed(got_calls) == calls
    assert len({call.id for call in got_calls}) == len(got_calls)


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_calls_are_left_as_content(name, text):
    content, calls = parse_tool_calls(text, get_tool_parser(name))
    assert (content, calls) == (text, [])


def stream(parser, text: str, sizes: list[int]) -> list[dict]:
    """The deltas for `text` arriving in pieces of the given sizes (cycled)."""
    tool_stream, deltas, end, i = parser.stream(), [], 0, 0
    while end < len(text):
        end = min(len(text), end + sizes[i % len(sizes)])
        i += 1
        delta = tool_stream.extract_delta(text[:end], finished=end == len(text))
        if delta:
            deltas.append(delta)
    return deltas


def reassemble(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """What an OpenAI client makes of the deltas: content joined, calls' arguments joined by index."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if piece["index"] == len(calls):
                assert piece["type"] == "function" and piece["id"] and piece["function"]["name"]
                calls.append({"id": piece["id"], "name": piece["function"]["name"], "arguments": ""})
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    return content or None, calls


@pytest.mark.parametrize("sizes", [[1], [2], [3, 1, 7], [1000]])
@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_deltas_reassemble_to_the_whole_texts_calls(name, text, content, calls, sizes):
    parser = get_tool_parser(name)
    got_content, got_calls = reassemble(stream(parser, text, sizes))
    whole_content, whole_calls = parser.extract(text)
    assert got_content == whole_content == content
    assert [(c["name"], c["arguments"]) for c in got_calls] == [(c.name, c.arguments) for c in whole_calls]
    if parser.name == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got_calls)
    else:
        assert all(c["id"].startswith("call_") for c in got_calls)


def test_a_stream_holds_back_what_may_start_a_call():
    tool_stream = get_tool_parser("hermes").stream()
    assert tool_stream.extract_delta("Hi <tool_c", finished=False) == {"content": "Hi"}
    assert tool_stream.extract_delta("Hi <tool_cat", finished=True) == {"content": " <tool_cat"}


def test_required_replies_are_arrays_of_name_and_parameters():
    text = json.dumps([{"name": "a", "parameters": PARIS}, {"name": "b", "parameters": NESTED}])
    parser = RequiredToolParser()
    content, calls = parser.extract(text)
    assert content is None and parsed(calls) == [("a", PARIS), ("b", NESTED)]
    streamed = reassemble(stream(parser, text, [1]))[1]
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert parser.extract("[]") == ("[]", [])
    assert parser.extract('[{"name": "a", "parameters": {}}] junk')[1] == []


def test_named_replies_are_the_arguments():
    parser = NamedToolParser("get_weather")
    text = json.dumps(PARIS, indent=2)
    content, calls = parser.extract(text)
    assert content is None and parsed(calls) == [("get_weather", PARIS)]
    assert reassemble(stream(parser, text, [1]))[1][0]["arguments"] == calls[0].arguments
    assert parser.extract('{"location": ') == ('{"location": ', [])


def test_value_end_skips_brackets_inside_strings():
    text = '{"a": "}]\\"{", "b": [1, {"c": "]"}]} tail'
    assert value_end(text, 0) == len(text) - len(" tail")
    assert value_end('{"a": "}', 0) is None


@pytest.mark.parametrize("template,expected", [
    ("... <tool_call>\\n{\\\"name\\\": ...", "hermes"),
    ("{{- '[TOOL_CALLS][' }}", "mistral"),
    ("<|start_header_id|>... {\"name\": function name, \"parameters\": ...}", "llama3_json"),
    ("{{ '<|python_tag|>' }}", "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_the_parser_is_recognised_from_the_template(template, expected):
    assert parser_for_template(template) == expected


def test_an_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("nope")
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}


@pytest.mark.parametrize("name, head", [("hermes", '<tool_call>{"name": "f", "arguments": {"a": '),
                                        ("llama3_json", '{"name": "f", "parameters": {"a": ')])
def test_a_long_streamed_call_is_scanned_once_not_once_per_step(monkeypatch, name, head):
    """Each step resumes the open arguments' scan where the last stopped: the JSON tokens visited over
    a whole stream stay a small multiple of the tokens in it (re-reading it all would be ~ steps x tokens)."""
    from llmpipe.tool_parsers import json_calls

    visited = 0
    tokens = json_calls._JSON_TOKENS

    class Counting:
        def finditer(self, text, pos):
            nonlocal visited
            for match in tokens.finditer(text, pos):
                visited += 1
                yield match

    monkeypatch.setattr(json_calls, "_JSON_TOKENS", Counting())
    body = "[" * 2000 + '"x", ' * 1000
    stream, text = get_tool_parser(name).stream(), head
    for i in range(0, len(body), 3):
        text += body[i : i + 3]
        stream.extract_delta(text, finished=False)
    assert stream.called
    assert visited <= 3 * (2000 + 1000)


@pytest.mark.parametrize("name, text", [
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": 1'),
    ("llama3_json", '{"name": "f", "parameters": {"a": [1, 2'),
])
def test_a_stream_cut_inside_a_call_does_not_resend_it_as_content(name, text):
    stream, deltas = get_tool_parser(name).stream(), []
    for end in range(1, len(text) + 1):
        deltas.append(stream.extract_delta(text[:end], finished=end == len(text)))
    content = "".join(d.get("content", "") for d in deltas)
    arguments = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", ()))
    assert stream.called and '"name"' not in content
    assert text.endswith(arguments) and content + arguments != text  # the call went once, as a call


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_a_name_json_cannot_spell_is_no_call_and_no_error(name):
    text = {"hermes": '<tool_call>{"name": "get\\_weather", "arguments": {}}</tool_call>',
            "llama3_json": '{"name": "get\\_weather", "parameters": {}}'}[name]
    content, calls = get_tool_parser(name).extract(text)
    assert calls == [] and content == text
