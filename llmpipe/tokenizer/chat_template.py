"""Rendering a model's Jinja chat template the way transformers' `apply_chat_template` does.

Templates ship inside model files, so they are untrusted code: they run in Jinja's immutable sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmpipe.errors import InvalidRequestError, ModelLoadError


# Names a message's reasoning arrives under; templates read the first (gpt-oss reads "thinking").
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class _TemplateRaised(jinja2.TemplateError):
    """The template itself rejected the conversation through `raise_exception`."""


def render_chat_template(
    template: str, messages: list[dict], *, add_generation_prompt: bool, **variables: Any
) -> str:
    """Render `messages`; `variables` are the named special tokens and any extras the template reads."""
    compiled = _compile(template)
    context = {"tools": None, "documents": None, **variables}
    try:
        return compiled.render(
            messages=[_prepare(message) for message in messages], add_generation_prompt=add_generation_prompt, **context
        )
    except _TemplateRaised as error:
        raise InvalidRequestError(f"the chat template rejected these messages: {error.message}") from error
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as error:
        # the template choked on what the request gave it (its messages, its extra variables)
        raise InvalidRequestError(f"the chat template failed on these messages: {error}", param="messages") from error


def _prepare(message: dict) -> dict:
    """A copy shaped as transformers hands it over: None-valued keys dropped (templates handle a missing
    key better), reasoning readable as both `reasoning_content` and `thinking`, and tool calls'
    arguments as a mapping."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    if message.get("tool_calls"):
        message["tool_calls"] = [_with_parsed_arguments(call) for call in message["tool_calls"]]
    return message


def _with_parsed_arguments(call: Any) -> Any:
    """OpenAI sends a call's arguments as JSON text; templates (Qwen 2.5, Llama 3.x) read them as a
    mapping, as transformers' docs pass them (vLLM parses them too). Text that is not JSON stays text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its context ("tools" in it: the template renders tools)."""
    _compile(template)  # a template that does not parse is the model's fault (ModelLoadError)
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ModelLoadError(f"the model's chat template does not parse: {error}") from error


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, > and &, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so a template cannot plant dunder attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `self` may be a kwarg name
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        super().__setitem__(name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates may not set namespace attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)
