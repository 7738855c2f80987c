"""Tools, assistant tool calls and tool messages reach the models' real chat templates (Qwen 2.5,
Qwen 3, Llama 3.1 / 3.2, Mistral Nemo) exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import transformers

from llmpipe.errors import InvalidRequestError
from llmpipe.server.input_processor import InputProcessor, validate_body
from llmpipe.server.protocol import ChatCompletionRequest
from llmpipe.tokenizer import Tokenizer, load_hf_tokenizer
from llmpipe.tool_parsers import parser_for_template
from tests.utils import TINY_CHAT_TEMPLATE
from tests.server.tool_fixtures import (
    LLAMA31, LLAMA32, MISTRAL_NEMO, QWEN3, QWEN25, TOOLS, as_transformers_takes_it, call, history, template,
)

ONE_CALL = [call("call_a1", "get_weather", {"city": "Paris", "unit": "celsius"})]
TWO_CALLS = [*ONE_CALL, call("call_b2", "search", {"query": "Paris événements", "limit": 3})]
MISTRAL_IDS = [call("a1b2c3d4e", "get_weather", {"city": "Paris", "unit": "celsius"})]
FIRST_TURN = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
KWARGS = {LLAMA32: {"date_string": "01 Dec 2026"}}  # else it renders today's date


@pytest.fixture(scope="module")
def tokenizers_(tiny_path):
    return load_hf_tokenizer(Path(tiny_path)), transformers.AutoTokenizer.from_pretrained(tiny_path)


def ours(tokenizer: Tokenizer, name: str, body: dict, parser: str | None = None, chat_template: str | None = None) -> str:
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = chat_template or template(name)
    request = validate_body(ChatCompletionRequest, {"chat_template_kwargs": KWARGS.get(name, {}), **body})
    return InputProcessor(tokenizer, 8192, "m", parser).chat_prompt(request, add_special_tokens=False)["prompt"]


def reference(hf_tokenizer, name: str, messages: list[dict], tools: list[dict] | None) -> str:
    return hf_tokenizer.apply_chat_template(
        as_transformers_takes_it(messages), tools=tools, chat_template=template(name), tokenize=False,
        add_generation_prompt=True, **KWARGS.get(name, {}),
    )


CASES = [
    (name, messages, tools)
    for name, calls in [(QWEN25, TWO_CALLS), (QWEN3, TWO_CALLS), (LLAMA31, ONE_CALL), (LLAMA32, ONE_CALL),
                        (MISTRAL_NEMO, MISTRAL_IDS)]
    for messages, tools in [(FIRST_TURN, TOOLS), (history(calls), TOOLS), (history(calls), None)]
]


@pytest.mark.parametrize("name,messages,tools", CASES, ids=[f"{c[0]}-{i % 3}" for i, c in enumerate(CASES)])
def test_rendering_matches_transformers(tokenizers_, name, messages, tools):
    tokenizer, hf_tokenizer = tokenizers_
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    expected = reference(hf_tokenizer, name, messages, tools)
    assert ours(tokenizer, name, body) == expected
    if tools:
        assert '"get_weather"' in expected  # the template did render the tools
    if len(messages) > 2:
        assert "Paris" in expected.split("Weather in Paris?", 1)[1]  # and the call's arguments


def test_the_parser_is_recognised_from_each_real_template():
    names = {name: parser_for_template(template(name)) for name in (QWEN25, QWEN3, LLAMA31, LLAMA32, MISTRAL_NEMO)}
    assert names == {QWEN25: "hermes", QWEN3: "hermes", LLAMA31: "llama3_json", LLAMA32: "llama3_json",
                     MISTRAL_NEMO: "mistral"}


@pytest.mark.parametrize("change,param", [
    (lambda m: m[2]["tool_calls"][0]["function"].update(arguments="{not json"), "messages[2].tool_calls[0].function.arguments"),
    (lambda m: m[2]["tool_calls"][0]["function"].update(arguments="[1, 2]"), "messages[2].tool_calls[0].function.arguments"),
    (lambda m: m[1].update(tool_calls=ONE_CALL), "messages[1].tool_calls"),
])
def test_bad_tool_calls_in_history_are_400s_naming_the_field(change, param):
    messages = copy.deepcopy(history(ONE_CALL))
    change(messages)
    with pytest.raises(InvalidRequestError) as err:
        validate_body(ChatCompletionRequest, {"messages": messages, "tools": TOOLS})
    assert err.value.param == param


def test_llm_chat_passes_tools_to_the_template(tmp_path):
    from llmpipe import LLM
    from llmpipe.sampling_params import SamplingParams
    from tests.server.tool_fixtures import checkpoint_with_template

    path = checkpoint_with_template(tmp_path, "qwen2", QWEN25)
    llm = LLM(str(path), progress=False)
    messages = history(TWO_CALLS)
    expected = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        as_transformers_takes_it(messages), tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert llm.chat_prompt(messages, tools=TOOLS)["prompt_token_ids"] == expected
    [output] = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0.0), tools=TOOLS)
    assert output.prompt_token_ids == expected


def test_a_template_that_renders_no_tools_gets_them_in_the_hermes_format(tokenizers_):
    """--tool-call-parser hermes on a template that renders no tools or calls (SmolLM2's, as the tiny
    model's): the tools' system prompt and the calling turn are exactly what Qwen 2.5's template (the
    format the hermes parser reads) writes; results come back in <tool_response> blocks."""
    tokenizer, _ = tokenizers_
    body = {"messages": history(TWO_CALLS), "tools": TOOLS}
    turns = ours(tokenizer, "", body, "hermes", TINY_CHAT_TEMPLATE).split("<|im_end|>\n")
    qwen_turns = ours(tokenizer, QWEN25, body).split("<|im_end|>\n")
    assert "<tools>" in turns[0] and turns[0] == qwen_turns[0]
    assert "<tool_call>" in turns[2] and turns[2] == qwen_turns[2]
    assert turns[3] == "<|im_start|>tool\n<tool_response>\nresult of get_weather\n</tool_response>"
    plain = ours(tokenizer, "", {"messages": FIRST_TURN}, "hermes", TINY_CHAT_TEMPLATE)
    assert plain == ours(tokenizer, "", {"messages": FIRST_TURN}, None, TINY_CHAT_TEMPLATE)  # no tools: as before


@pytest.mark.parametrize("parser,body,param", [
    (None, {"messages": history(ONE_CALL)}, "messages[2].tool_calls"),  # would render as an empty turn
    ("llama3_json", {"messages": history(ONE_CALL)}, "messages[2].tool_calls"),
    ("llama3_json", {"messages": FIRST_TURN, "tools": TOOLS}, "tools"),  # "auto": the model would never see them
])
def test_tools_or_calls_a_template_cannot_render_and_no_parser_can_write_are_400s(tokenizers_, parser, body, param):
    tokenizer = copy.copy(tokenizers_[0])
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    with pytest.raises(InvalidRequestError) as err:
        InputProcessor(tokenizer, 8192, "m", parser).chat(validate_body(ChatCompletionRequest, body))
    assert err.value.param == param and "hermes" in str(err.value)
