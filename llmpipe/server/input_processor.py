"""Requests → engine inputs, on the API side: parse and check a body, apply the chat template,
tokenize, build SamplingParams and the reply's format; and the /tokenize and /detokenize replies.

Everything here may be slow for a big request, so the server runs it on its worker pool, never on
the event loop. Token ids, not text, go on to the engine.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Iterator, TypeVar

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from llmpipe.errors import InvalidRequestError
from llmpipe.server.errors import ModelNotFoundError
from llmpipe.server.openai_format import ChatFormat, CompletionFormat
from llmpipe.server.responses import ResponseShape, chat_error
from llmpipe.server.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from llmpipe.server.tool_calling import template_input, tool_calling
from llmpipe.tokenizer import Tokenizer

JSON_SLICE = 65_536  # list items rendered per json.dumps call in a long reply
# Deepest nesting of arrays and objects a body may have. Python's json.loads fails at ~1,000 levels
# (RecursionError), and what recurses over a body after it (pydantic, Jinja's tojson in the chat
# template, llguidance compiling a schema) may take several frames a level; 128 is serde_json's
# default limit, leaving them room many times over, and far beyond any real request (OpenAI's
# structured outputs allow 10 levels of schema nesting, some 25 levels of JSON).
MAX_JSON_DEPTH = 128
CONTAINERS = (list, dict)  # what json.loads nests
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools"})
Body = TypeVar("Body", bound=BaseModel)


class InputProcessor:
    """Turns one model's request bodies into (body, prompt, SamplingParams, reply format)."""

    def __init__(
        self, tokenizer: Tokenizer | None, max_model_len: int, model_name: str, tool_call_parser: str | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser  # None: chosen from the chat template
        self.loras: dict[str, str] = {}  # the LoRA adapters loaded (the AsyncEngine's, kept up to date there)

    def check_model(self, name: str | None, adapters: bool = False) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a model not served.
        `adapters` False: a route that serves the base model only (embeddings, rerank, score)."""
        if name is None or name == self.model_name:
            return None
        if name in self.loras:
            if not adapters:
                raise InvalidRequestError(f"{name!r} is a LoRA adapter; adapters serve generation only, this route "
                                          f"serves {self.model_name!r}", param="model")
            return name
        served = ", ".join(repr(n) for n in [self.model_name, *self.loras])
        raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {served}")

    def tokenizer(self) -> Tokenizer:
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send the prompt as token ids", param="prompt")
        return tokenizer

    def max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The request's max_tokens, or what is left of the context; 400 when it does not fit."""
        limit = self.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise InvalidRequestError(
                    f"the prompt has {prompt_len} tokens; max_model_len is {limit}", code="context_length_exceeded"
                )
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({requested}) = {prompt_len + requested} "
                f"is over max_model_len ({limit})",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def encode(self, text: str, add_special_tokens: bool, param: str, unbounded: bool) -> list[int]:
        """Token ids of a prompt; one far over the context is refused before it is tokenized (unless
        `unbounded`: it will be truncated, or only counted)."""
        tokenizer = self.tokenizer()
        fewest = tokenizer.fewest_tokens(text)
        if not unbounded and fewest >= self.max_model_len:
            raise InvalidRequestError(
                f"{param}: {len(text)} characters are at least {fewest} tokens, over max_model_len ({self.max_model_len})",
                param=param,
                code="context_length_exceeded",
            )
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: as many as leave room for one more)."""
        if keep is None:
            return token_ids
        if keep == 0:
            raise InvalidRequestError("truncate_prompt_tokens must be -1 or >= 1, got 0", param="truncate_prompt_tokens")
        keep = self.max_model_len - 1 if keep == -1 else keep
        return token_ids[-keep:]

    def chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool,
                    counted: bool = False) -> dict:
        """The conversation as a prompt (as LLM.chat_prompt, but refusing one far over the context
        before tokenizing it, unless it will be truncated or only counted)."""
        kwargs = body.chat_template_kwargs or {}
        reserved = RESERVED_TEMPLATE_VARIABLES & set(kwargs)
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs: {sorted(reserved)[0]!r} is set by the request itself", param="chat_template_kwargs"
            )
        tokenizer = self.tokenizer()
        messages, tools = template_input(body, self.tool_call_parser, tokenizer.chat_template)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, tools=tools, **kwargs)
        unbounded = counted or isinstance(body, TokenizeRequest) or body.truncate_prompt_tokens is not None
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens, "messages", unbounded)}

    def completion(self, raw: bytes) -> tuple:
        """(body, [(prompt, SamplingParams)]: one engine request per prompt of the body, reply format)."""
        body = parse_body(CompletionRequest, raw)
        self.check_model(body.model, adapters=True)
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo:  # vLLM: echo's logprobs cover the prompt too
            prompt_logprobs = body.logprobs
        requests = []
        for prompt in prompt_list(body.prompt):
            prompt = self.text_prompt(prompt, body.add_special_tokens, body.truncate_prompt_tokens)
            if body.cache_salt is not None:
                prompt["cache_salt"] = body.cache_salt
            params = body.sampling_params(self.max_tokens(len(prompt["prompt_token_ids"]), body.max_tokens), body.logprobs)
            requests.append((prompt, replace(params, prompt_logprobs=prompt_logprobs)))
        tokenizer = self._tokenizer
        fmt = CompletionFormat(
            f"cmpl-{uuid.uuid4().hex}", body.model or self.model_name, body.logprobs, body.return_tokens_as_token_ids,
            echo=body.echo, decode=(lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else None,
        )
        return body, requests, fmt

    def text_prompt(self, prompt: str | list[int], add_special_tokens: bool, keep: int | None,
                    param: str = "prompt") -> dict:
        """A completions prompt or an embeddings input (text or token ids) as the engine's prompt, its last
        `keep` tokens kept (truncate_prompt_tokens)."""
        if isinstance(prompt, str):
            ids = self.encode(prompt, add_special_tokens, param, keep is not None)
            kept = self.truncate(ids, keep)
            # A cut prompt's text is no longer the text of its tokens: echo decodes the tokens kept.
            return {"prompt": prompt, "prompt_token_ids": kept} if len(kept) == len(ids) else {"prompt_token_ids": kept}
        return {"prompt_token_ids": self.truncate(prompt, keep)}

    def chat_completion(self, raw: bytes) -> tuple:
        return self.chat(parse_body(ChatCompletionRequest, raw))

    def chat(self, body: ChatCompletionRequest) -> tuple:
        self.check_model(body.model, adapters=True)
        tools = tool_calling(body, self.tool_call_parser, self._tokenizer.chat_template if self._tokenizer else None)
        prompt = self.chat_prompt(body, body.add_special_tokens)
        prompt["prompt_token_ids"] = self.truncate(prompt["prompt_token_ids"], body.truncate_prompt_tokens)
        if body.cache_salt is not None:
            prompt["cache_salt"] = body.cache_salt
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(self.max_tokens(len(prompt["prompt_token_ids"]), requested), logprobs)
        tools.apply(params)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", body.model or self.model_name, logprobs, body.return_tokens_as_token_ids,
                         token_bytes=self._tokenizer.token_bytes if self._tokenizer else None, tool_parser=tools.parser)
        return body, [(prompt, replace(params, prompt_logprobs=body.prompt_logprobs))], fmt

    def response(self, raw: bytes) -> tuple:
        """A Responses API body, run as the chat completion it amounts to (see server/responses.py)."""
        body = parse_body(ResponsesRequest, raw)
        try:
            chat = self.chat(validate_body(ChatCompletionRequest, body.chat_body()))
        except InvalidRequestError as err:
            raise chat_error(err) from None
        return (*chat, ResponseShape(body, body.model or self.model_name))

    def tokenize(self, raw: bytes) -> Response:
        body = parse_body(TokenizeRequest, raw)
        self.check_model(body.model, adapters=True)  # an adapter tokenizes as its base model
        tokenizer = self.tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("send exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            tokens = self.chat_prompt(body, add_special_tokens=False)["prompt_token_ids"]
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        reply = {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            reply["token_strs"] = [tokenizer.id_to_token(t) for t in tokens]
        return json_response(reply)

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's configuration, as clients with a remote tokenizer
        (lm-evaluation-harness) read it: its special tokens, chat template and length limit."""
        tokenizer = self.tokenizer()
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",  # what transformers wraps a tokenizers.Tokenizer in
            "name_or_path": self.model_name,
            **{name: tokenizer.special_tokens.get(name) for name in names},
            "add_bos_token": tokenizer.add_bos_token,
            "model_max_length": self.max_model_len,
            "chat_template": tokenizer.chat_template,
        }

    def detokenize(self, raw: bytes) -> Response:
        body = parse_body(DetokenizeRequest, raw)
        self.check_model(body.model, adapters=True)
        tokenizer = self.tokenizer()
        vocab = tokenizer.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"tokens must be ids in [0, {vocab}), got {bad}", param="tokens")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})


def parse_body(model: type[Body], raw: bytes) -> Body:
    """The request body as `model`: JSON parsed, types checked strictly, refused fields refused."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InvalidRequestError(f"malformed JSON body: {err}", code="invalid_json") from None
    except RecursionError:  # far over the cap
        raise _too_deep() from None
    if not _within_depth(data, raw):
        raise _too_deep()
    return validate_body(model, data)


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")


def _within_depth(data: object, raw: bytes) -> bool:
    """Whether `data` nests at most MAX_JSON_DEPTH arrays / objects deep; a level at a time, with no
    recursion of its own (and at once for a body with fewer brackets than the cap)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return True
    level = [data] if type(data) in CONTAINERS else []
    for _ in range(MAX_JSON_DEPTH):
        if not level:
            return True
        level = _nested(level)
    return not level


def _nested(level: list) -> list:
    """The arrays and objects directly inside those of `level`; a long list of scalars is skipped at C speed."""
    inside = []
    for node in level:
        items = node.values() if type(node) is dict else node
        if len(items) > 32 and list not in (kinds := set(map(type, items))) and dict not in kinds:
            continue
        inside += [item for item in items if type(item) in CONTAINERS]
    return inside


def validate_body(model: type[Body], data: object) -> Body:
    """A parsed JSON body as `model` (see parse_body)."""
    if not isinstance(data, dict):
        raise InvalidRequestError("the body must be a JSON object", code="invalid_type")
    _check_list_caps(model, data)
    body = model.model_validate(data)
    body.check_supported()
    return body


def _check_list_caps(model: type[BaseModel], data: dict) -> None:
    """A top-level list over its cap is refused before validation, which would hold the GIL for
    every item (200,000 messages: a second)."""
    for name, info in model.model_fields.items():
        value = data.get(name)
        cap = next((m.max_length for m in info.metadata if getattr(m, "max_length", None) is not None), None)
        if isinstance(value, list) and cap is not None and len(value) > cap:
            raise InvalidRequestError(f"{name}: at most {cap} items, got {len(value)}", param=name)


def json_response(reply: dict) -> Response:
    """`reply` as JSON; one with a long list is rendered a slice at a time as it is sent (on
    Starlette's thread pool), since one json.dumps of 2 M token ids holds the GIL for ~0.4 s."""
    if all(not isinstance(v, list) or len(v) <= JSON_SLICE for v in reply.values()):
        return JSONResponse(reply)

    def render() -> Iterator[str]:
        for i, (key, value) in enumerate(reply.items()):
            yield ("{" if i == 0 else ", ") + json.dumps(key) + ": "
            if not isinstance(value, list):
                yield json.dumps(value, ensure_ascii=False)
                continue
            yield "["
            for start in range(0, len(value), JSON_SLICE):
                part = json.dumps(value[start : start + JSON_SLICE], ensure_ascii=False)[1:-1]
                yield (", " if start else "") + part
            yield "]"
        yield "}"

    return StreamingResponse(render(), media_type="application/json")


def prompt_list(prompt: str | list, cap: int = MAX_PROMPTS, param: str = "prompt") -> list[str | list[int]]:
    """The body's prompts: a string or a list of token ids is one; a list of either is a batch (of `cap` at most)."""
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))):
        return [prompt]
    if len(prompt) > cap:
        raise InvalidRequestError(f"{param}: at most {cap} prompts per request, got {len(prompt)}", param=param)
    return prompt
