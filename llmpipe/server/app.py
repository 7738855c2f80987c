"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine.

Routes: /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health, /metrics,
/tokenize, /detokenize, and / (the playground page).

Nothing heavy runs on the event loop: parsing and validating a body, chat templating, tokenizing
and rendering a large reply run on a small worker pool (`Server.offload`), so one 7 MiB request
never stalls /health or another client's stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.llm import LLM
from llmpipe.outputs import RequestOutput
from llmpipe.sampling_params import SamplingParams
from llmpipe.server.async_engine import AsyncEngine, RequestStream, UnavailableError
from llmpipe.server.errors import ModelNotFoundError, install_error_handlers, llmpipe_error_body
from llmpipe.server.http import BODY_TIMEOUT_S
from llmpipe.server.metrics import ServerMetrics
from llmpipe.server.middleware import ApiKey, BodyLimit
from llmpipe.server.openai_format import ChatFormat, CompletionFormat, Format, StreamState, stream_chunks
from llmpipe.server.protocol import (
    REQUESTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from llmpipe.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 2**20
API_WORKERS = 4  # threads that parse, template and tokenize requests off the event loop
JSON_SLICE = 65_536  # list items rendered per json.dumps call in a long reply
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt"})
Body = TypeVar("Body", bound=BaseModel)
router = APIRouter()


class Server:
    """What the routes share: the model, its async engine, the metrics."""

    def __init__(self, llm: LLM, model_name: str, max_waiting: int | None, before_step: Callable[[], None] | None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine.stats)
        self.engine = AsyncEngine(llm.engine, max_waiting, on_output=self.metrics.observe, before_step=before_step)
        self.pool = ThreadPoolExecutor(API_WORKERS, thread_name_prefix="llmpipe-api")

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.config.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {self.model_name!r}")

    def tokenizer(self) -> Tokenizer:
        tokenizer = self.llm.get_tokenizer()
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

    async def offload(self, work: Callable[..., Any], *args: Any) -> Any:
        """Run `work` on the worker pool, leaving the event loop free."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, work, *args)

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

    def chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool) -> dict:
        """The conversation as a prompt (as LLM.chat_prompt, but refusing one far over the context
        before tokenizing it, unless it will be truncated or only counted)."""
        kwargs = body.chat_template_kwargs or {}
        reserved = RESERVED_TEMPLATE_VARIABLES & set(kwargs)
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs: {sorted(reserved)[0]!r} is set by the request itself", param="chat_template_kwargs"
            )
        messages = [m.as_template_input() for m in body.messages]
        text = self.tokenizer().apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **kwargs)
        unbounded = isinstance(body, TokenizeRequest) or body.truncate_prompt_tokens is not None
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens, "messages", unbounded)}

    def completion(self, raw: bytes) -> tuple:
        body = parse_body(CompletionRequest, raw)
        self.check_model(body.model)
        prompt = _single_prompt(body.prompt)
        truncating = body.truncate_prompt_tokens is not None
        if isinstance(prompt, str):
            ids = self.encode(prompt, body.add_special_tokens, "prompt", truncating)
            prompt = {"prompt": prompt, "prompt_token_ids": self.truncate(ids, body.truncate_prompt_tokens)}
        else:
            prompt = {"prompt_token_ids": self.truncate(prompt, body.truncate_prompt_tokens)}
        params = body.sampling_params(self.max_tokens(len(prompt["prompt_token_ids"]), body.max_tokens), body.logprobs)
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", self.model_name, body.logprobs, body.return_tokens_as_token_ids)
        return body, prompt, params, fmt

    def chat_completion(self, raw: bytes) -> tuple:
        body = parse_body(ChatCompletionRequest, raw)
        self.check_model(body.model)
        prompt = self.chat_prompt(body, body.add_special_tokens)
        prompt["prompt_token_ids"] = self.truncate(prompt["prompt_token_ids"], body.truncate_prompt_tokens)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(self.max_tokens(len(prompt["prompt_token_ids"]), requested), logprobs)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, logprobs, body.return_tokens_as_token_ids)
        return body, prompt, params, fmt

    def tokenize(self, raw: bytes) -> Response:
        body = parse_body(TokenizeRequest, raw)
        self.check_model(body.model)
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

    def detokenize(self, raw: bytes) -> Response:
        body = parse_body(DetokenizeRequest, raw)
        self.check_model(body.model)
        tokenizer = self.tokenizer()
        vocab = tokenizer.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"tokens must be ids in [0, {vocab}), got {bad}", param="tokens")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})

    async def respond(self, request: Request, body: SamplingFields, prompt: dict, params: SamplingParams, fmt: Format):
        if body.user or body.safety_identifier:
            logger.debug("request for user %r", body.user or body.safety_identifier)
        stream = await self.engine.add(prompt, params)
        if body.stream:
            return _EngineStreamResponse(_sse(stream, fmt, params.n, body.include_usage), stream)
        try:
            final = await _unless_disconnected(request, _last(stream))
        finally:
            stream.abort()
        if final is None:
            return Response(status_code=499)
        return await self.offload(lambda: JSONResponse(fmt.body(final)))


def parse_body(model: type[Body], raw: bytes) -> Body:
    """The request body as `model`: JSON parsed, types checked strictly, refused fields refused."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InvalidRequestError(f"malformed JSON body: {err}", code="invalid_json") from None
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


def json_body(model: type[BaseModel]) -> dict:
    """OpenAPI for a route that parses its own body (off the event loop) as `model`."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def request_schemas() -> dict:
    """JSON schemas of every request body and what they nest, for OpenAPI's components."""
    schemas = {}
    for model in REQUESTS.values():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def _server(request: Request) -> Server:
    return request.app.state.server


class _EngineStreamResponse(StreamingResponse):
    """An SSE response that aborts its request however it ends (done, disconnect, shutdown)."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _sse(stream: RequestStream, fmt: Format, n: int, include_usage: bool) -> AsyncIterator[str]:
    sent = [StreamState() for _ in range(n)]
    try:
        async for output in stream:
            chunks = stream_chunks(fmt, output, sent)
            for chunk in chunks:
                if include_usage:
                    chunk["usage"] = None
            if output.finished and not include_usage and chunks:
                chunks[-1]["llmpipe_timing"] = output.metrics.timing_breakdown()
            for chunk in chunks:
                yield _event(chunk)
            if output.finished and include_usage:
                yield _event(fmt.usage_chunk(output))
    except LLMPipeError as err:  # the engine failed it, or the server is shutting down
        yield _event(llmpipe_error_body(err))
    yield "data: [DONE]\n\n"


async def _last(stream: RequestStream) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    return final


async def _unless_disconnected(request: Request, work):
    """Run `work`; if the client hangs up first, cancel it and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _single_prompt(prompt: str | list) -> str | list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequestError(
                "prompt: a batch of prompts is not supported; send one prompt per request",
                param="prompt",
                code="unsupported_parameter",
            )
        return prompt[0]
    return prompt


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def completions(request: Request):
    server = _server(request)
    return await server.respond(request, *await server.offload(server.completion, await request.body()))


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request):
    server = _server(request)
    return await server.respond(request, *await server.offload(server.chat_completion, await request.body()))


@router.get("/v1/models")
async def models(request: Request) -> dict:
    server = _server(request)
    card = {
        "id": server.model_name,
        "object": "model",
        "created": server.created,
        "owned_by": "llmpipe",
        "max_model_len": server.max_model_len,
    }
    return {"object": "list", "data": [card]}


@router.get("/health")
async def health(request: Request) -> dict:
    engine = _server(request).engine
    if not engine.alive:
        raise UnavailableError("the engine thread has stopped")
    if engine.closing:  # draining: a load balancer should stop sending here
        raise UnavailableError("the server is shutting down")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(request: Request) -> Response:
    server = _server(request)
    return await server.offload(server.tokenize, await request.body())


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    server = _server(request)
    return await server.offload(server.detokenize, await request.body())


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(resources.files("llmpipe.server").joinpath("static/playground.html").read_text("utf-8"))


def create_app(
    llm: LLM,
    model_name: str,
    *,
    api_key: str | None = None,
    max_waiting: int | None = 512,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout: float = BODY_TIMEOUT_S,
    before_step: Callable[[], None] | None = None,
) -> FastAPI:
    """`before_step`: called on the engine thread before each step (see AsyncEngine)."""
    server = Server(llm, model_name, max_waiting, before_step)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        await server.engine.stop()
        server.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="llmpipe", description="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.server = server
    default_openapi = app.openapi

    def openapi() -> dict:
        schema = default_openapi()
        schema.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
        return schema

    app.openapi = openapi
    app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=body_timeout)
    if api_key:  # added last = runs first: no body is read for a client without the key
        app.add_middleware(ApiKey, api_key=api_key)
    return app
