"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine.

Routes: /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health, /metrics,
/tokenize, /detokenize, and / (the playground page).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from importlib import resources
from typing import AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.llm import LLM
from llmpipe.outputs import RequestOutput
from llmpipe.sampling_params import SamplingParams
from llmpipe.server.async_engine import AsyncEngine, RequestStream, UnavailableError
from llmpipe.server.errors import ModelNotFoundError, error_body, install_error_handlers, status_of
from llmpipe.server.metrics import ServerMetrics
from llmpipe.server.middleware import ApiKey, BodyLimit
from llmpipe.server.openai_format import ChatFormat, CompletionFormat, Format, StreamState, stream_chunks
from llmpipe.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from llmpipe.tokenizer import Tokenizer

MAX_BODY_BYTES = 8 * 2**20
router = APIRouter()


class Server:
    """What the routes share: the model, its async engine, the metrics."""

    def __init__(self, llm: LLM, model_name: str, max_waiting: int | None, before_step: Callable[[], None] | None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine.stats)
        self.engine = AsyncEngine(llm.engine, max_waiting, on_output=self.metrics.observe, before_step=before_step)

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.config.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {self.model_name!r}")

    def tokenizer(self) -> Tokenizer:
        tokenizer = self.llm.get_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send the prompt as token ids")
        return tokenizer

    def max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The request's max_tokens, or what is left of the context; 400 when it does not fit."""
        limit = self.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise InvalidRequestError(f"the prompt has {prompt_len} tokens; max_model_len is {limit}")
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({requested}) = {prompt_len + requested} "
                f"is over max_model_len ({limit})"
            )
        return requested

    async def respond(self, request: Request, body: SamplingFields, prompt: dict, params: SamplingParams, fmt: Format):
        stream = await self.engine.add(prompt, params)
        if body.stream:
            return _EngineStreamResponse(_sse(stream, fmt, params.n, body.include_usage), stream)
        try:
            final = await _unless_disconnected(request, _last(stream))
        finally:
            stream.abort()
        return fmt.body(final) if final is not None else Response(status_code=499)


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
        yield _event(error_body(status_of(err), str(err)))
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
            raise InvalidRequestError("prompt: a batch of prompts is not supported; send one prompt per request")
        return prompt[0]
    return prompt


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    server = _server(request)
    server.check_model(body.model)
    if body.echo:
        raise InvalidRequestError("echo: true is not supported")
    prompt = _single_prompt(body.prompt)
    if isinstance(prompt, str):
        prompt = {"prompt": prompt, "prompt_token_ids": server.tokenizer().encode(prompt)}
    else:
        prompt = {"prompt_token_ids": prompt}
    params = body.sampling_params(server.max_tokens(len(prompt["prompt_token_ids"]), body.max_tokens), body.logprobs)
    fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", server.model_name, body.logprobs, body.return_tokens_as_token_ids)
    return await server.respond(request, body, prompt, params, fmt)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    server = _server(request)
    server.check_model(body.model)
    server.tokenizer()
    prompt = server.llm.chat_prompt([m.as_template_input() for m in body.messages], body.add_generation_prompt)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = body.sampling_params(server.max_tokens(len(prompt["prompt_token_ids"]), requested), logprobs)
    fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", server.model_name, logprobs, body.return_tokens_as_token_ids)
    return await server.respond(request, body, prompt, params, fmt)


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
    if not _server(request).engine.alive:
        raise UnavailableError("the engine thread has stopped")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    server = _server(request)
    server.check_model(body.model)
    tokenizer = server.tokenizer()
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("send exactly one of prompt or messages")
    if body.messages is not None:
        messages = [m.as_template_input() for m in body.messages]
        tokens = server.llm.chat_prompt(messages, body.add_generation_prompt)["prompt_token_ids"]
    else:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": server.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    server = _server(request)
    server.check_model(body.model)
    tokenizer = server.tokenizer()
    bad = [t for t in body.tokens if t >= tokenizer.vocab_size]
    if bad:
        raise InvalidRequestError(f"tokens must be ids in [0, {tokenizer.vocab_size}), got {bad[0]}")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


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
    before_step: Callable[[], None] | None = None,
) -> FastAPI:
    """`before_step`: called on the engine thread before each step (see AsyncEngine)."""
    server = Server(llm, model_name, max_waiting, before_step)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        await server.engine.stop()

    app = FastAPI(title="llmpipe", description="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.server = server
    app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:  # added last = runs first: no body is read for a client without the key
        app.add_middleware(ApiKey, api_key=api_key)
    return app
