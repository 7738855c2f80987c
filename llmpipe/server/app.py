"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine (the front end of an engine
core in its own process under `llmpipe serve`, or of an in-process `LLM`'s core on a thread).

Routes: /v1/completions, /v1/chat/completions (streaming or not), /v1/responses, /v1/messages,
/v1/embeddings, /v1/rerank, /v1/score, /v1/models, /v1/load_lora_adapter, /v1/unload_lora_adapter, /health,
/metrics, /tokenize, /detokenize, /tokenizer_info, and / (the playground page).

Nothing heavy runs on the event loop: parsing and validating a body, chat templating, tokenizing
and rendering a large reply run on a small worker pool (`Server.offload`), so one 7 MiB request
never stalls /health or another client's stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from llmpipe.errors import InvalidRequestError
from llmpipe.llm import LLM
from llmpipe.outputs import RequestOutput
from llmpipe.sampling_params import SamplingParams
from llmpipe.loader.aliases import resolve_model
from llmpipe.pooling.prompts import SentencePrompts
from llmpipe.pooling.rerank_prompt import ScorePrompts
from llmpipe.pooling_params import PoolingParams
from llmpipe.server.pooling import embedding_inputs, embedding_reply, rerank_inputs, rerank_reply, score_inputs, score_reply
from llmpipe.server.pooling_protocol import POOLING_REQUESTS, EmbeddingRequest, RerankRequest, ScoreRequest
from llmpipe.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from llmpipe.server.anthropic import MessageShape, anthropic_errors, count_tokens, messages_request
from llmpipe.server.async_engine import AsyncEngine, RequestStream, UnavailableError
from llmpipe.server.request_batch import RequestBatch
from llmpipe.server.errors import install_error_handlers
from llmpipe.server.http import BODY_TIMEOUT_S
from llmpipe.server.input_processor import InputProcessor, parse_body
from llmpipe.server.metrics import ServerMetrics
from llmpipe.server.middleware import ApiKey, BodyLimit
from llmpipe.server.openai_format import Format
from llmpipe.server.responses import ResponseShape
from llmpipe.server.sse import sse_json
from llmpipe.structured_output.sandbox import grammar_sandbox
from llmpipe.server.protocol import (
    REQUESTS,
    ResponsesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    SamplingFields,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 2**20
API_WORKERS = 4  # threads that parse, template and tokenize requests off the event loop
router = APIRouter()


class Server:
    """What the routes share: the async engine, the request parsing, the metrics."""

    def __init__(self, engine: AsyncEngine, model_name: str, tool_call_parser: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.engine.labelled_stats)
        engine.on_output = self.metrics.observe
        self.pool = ThreadPoolExecutor(API_WORKERS, thread_name_prefix="llmpipe-api")
        self.inputs = InputProcessor(engine.tokenizer, engine.max_model_len, model_name, tool_call_parser)
        self.inputs.loras = engine.loras  # one dict: the engine updates it as adapters load and unload
        info = engine.info
        self.score_prompts = ScorePrompts(info.task, not info.generates, engine.tokenizer, info.max_model_len, model_name)
        self.sentence_prompts = SentencePrompts.read(resolve_model(info.model))

    @property
    def max_model_len(self) -> int:
        return self.inputs.max_model_len

    async def pooled(self, request: Request, prompts: list[dict], params: PoolingParams,
                   reply: Callable[[list[RequestOutput]], dict]) -> Response:
        """Run the pooling requests of one body together; their reply, rendered off the event loop."""
        finals = await _finals(request, await RequestBatch.start(self.engine, [(p, params) for p in prompts], None))
        if finals is None:
            return Response(status_code=499)
        return await self.offload(lambda: JSONResponse(reply(finals)))

    async def offload(self, work: Callable[..., Any], *args: Any) -> Any:
        """Run `work` on the worker pool, leaving the event loop free."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, work, *args)

    async def respond(
        self, request: Request, body: SamplingFields, requests: list[tuple[dict, SamplingParams]], fmt: Format,
        shape: ResponseShape | MessageShape | None = None,
    ):
        """The reply to one body's engine requests (one per prompt): chat / completion JSON or SSE
        chunks, or (with `shape`) the Responses API's or the Messages API's object or events."""
        if body.user or body.safety_identifier:
            logger.debug("request for user %r", body.user or body.safety_identifier)
        lora_name = self.inputs.check_model(body.model, adapters=True)  # checked when parsed; here: which adapter
        batch = await RequestBatch.start(self.engine, requests, fmt, lora_name)
        if body.stream:
            chunks = batch.chunks(body.include_usage)
            return _EngineStreamResponse(shape.events(chunks) if shape else _sse(chunks), batch)
        finals = await _finals(request, batch)
        if finals is None:
            return Response(status_code=499)
        return await self.offload(lambda: JSONResponse(shape.body(batch.body(finals)) if shape else batch.body(finals)))


def json_body(model: type[BaseModel]) -> dict:
    """OpenAPI for a route that parses its own body (off the event loop) as `model`."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def request_schemas() -> dict:
    """JSON schemas of every request body and what they nest, for OpenAPI's components."""
    schemas = {}
    for model in [*REQUESTS.values(), *POOLING_REQUESTS.values(), MessagesRequest, CountTokensRequest,
                  LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def _server(request: Request) -> Server:
    return request.app.state.server


class _EngineStreamResponse(StreamingResponse):
    """An SSE response that aborts its request however it ends (done, disconnect, shutdown)."""

    def __init__(self, content: AsyncIterator[str], stream: RequestBatch) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


def _event(data: dict) -> str:
    return f"data: {sse_json(data)}\n\n"


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield _event(chunk)
    yield "data: [DONE]\n\n"


async def _finals(request: Request, batch: RequestBatch) -> list[RequestOutput] | None:
    """Every stream's last output, or None if the client hung up first; the batch is aborted however it ends."""
    try:
        return await _unless_disconnected(request, asyncio.gather(*(_last(stream) for stream in batch.streams)))
    finally:
        batch.abort()


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
    # A cancelled gather ends with its CancelledError set as an exception (not as cancelled): unless
    # it is retrieved, asyncio logs "exception was never retrieved" at ERROR for every hang-up.
    task.add_done_callback(_retrieve)
    return None


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def completions(request: Request):
    server = _server(request)
    return await server.respond(request, *await server.offload(server.inputs.completion, await request.body()))


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request):
    server = _server(request)
    return await server.respond(request, *await server.offload(server.inputs.chat_completion, await request.body()))


@router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))
async def responses(request: Request):
    server = _server(request)
    return await server.respond(request, *await server.offload(server.inputs.response, await request.body()))


# Anthropic's Messages API: run as chat completions (server/anthropic.py), errors in Anthropic's shape.
@router.post("/v1/messages", openapi_extra=json_body(MessagesRequest))
async def anthropic_messages(request: Request) -> Response:
    server = _server(request)

    async def reply() -> Response:
        return await server.respond(request, *await server.offload(messages_request, server.inputs, await request.body()))

    return await anthropic_errors(request, reply())


@router.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
async def anthropic_count_tokens(request: Request) -> Response:
    server = _server(request)
    return await anthropic_errors(request, server.offload(count_tokens, server.inputs, await request.body()))


# Embeddings, rerank and score (server/pooling.py): one pooling request per input or pair.
@router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest))
async def embeddings(request: Request) -> Response:
    server = _server(request)
    body, prompts, params = await server.offload(embedding_inputs, server.inputs, server.sentence_prompts,
                                                 await request.body())
    return await server.pooled(request, prompts, params, lambda finals: embedding_reply(server.model_name, body, finals))


@router.post("/v1/rerank", openapi_extra=json_body(RerankRequest))
@router.post("/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
async def rerank(request: Request) -> Response:
    server = _server(request)
    body, prompts = await server.offload(rerank_inputs, server.inputs, server.score_prompts, await request.body())
    return await server.pooled(request, prompts, PoolingParams("score"),
                             lambda finals: rerank_reply(server.model_name, body, finals))


@router.post("/v1/score", openapi_extra=json_body(ScoreRequest))
async def score(request: Request) -> Response:
    server = _server(request)
    _, prompts = await server.offload(score_inputs, server.inputs, server.score_prompts, await request.body())
    return await server.pooled(request, prompts, PoolingParams("score"), lambda finals: score_reply(server.model_name, finals))


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
    adapters = [{"id": name, "object": "model", "created": server.created, "owned_by": "llmpipe", "root": path,
                 "parent": server.model_name, "max_model_len": server.max_model_len}
                for name, path in server.engine.loras.items()]
    return {"object": "list", "data": [card, *adapters]}


# LoRA adapters at run time (vLLM's routes; with --enable-lora): loaded or unloaded between two engine steps.
@router.post("/v1/load_lora_adapter", openapi_extra=json_body(LoadLoRAAdapterRequest))
async def load_lora_adapter(request: Request) -> Response:
    server = _server(request)
    body = parse_body(LoadLoRAAdapterRequest, await request.body())
    if body.lora_name == server.model_name:
        raise InvalidRequestError(f"{body.lora_name!r} is the base model's name", param="lora_name")
    await server.engine.load_lora(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=json_body(UnloadLoRAAdapterRequest))
async def unload_lora_adapter(request: Request) -> Response:
    server = _server(request)
    body = parse_body(UnloadLoRAAdapterRequest, await request.body())
    await server.engine.unload_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.get("/health")
async def health(request: Request) -> dict:
    engine = _server(request).engine
    if not engine.alive:
        raise UnavailableError("the engine core has stopped")
    if engine.closing:  # draining: a load balancer should stop sending here
        raise UnavailableError("the server is shutting down")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(request: Request) -> Response:
    server = _server(request)
    return await server.offload(server.inputs.tokenize, await request.body())


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    return _server(request).inputs.tokenizer_info()


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    server = _server(request)
    return await server.offload(server.inputs.detokenize, await request.body())


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(resources.files("llmpipe.server").joinpath("static/playground.html").read_text("utf-8"))


def create_app(
    engine: LLM | AsyncEngine,
    model_name: str,
    *,
    api_key: str | None = None,
    max_waiting: int | None = 512,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout: float = BODY_TIMEOUT_S,
    before_step: Callable[[], None] | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """Serve `engine`: an AsyncEngine (over a core process: `llmpipe serve`), or an in-process LLM,
    whose core then steps on a thread, calling `before_step` before each step (see CoreLoop).
    `tool_call_parser`: the name of the parser that reads tool calls (None: chosen from the chat template)."""
    if isinstance(engine, LLM):
        engine = AsyncEngine(engine.engine.thread_client(before_step), engine.engine.tokenizer, max_waiting)
    server = Server(engine, model_name, tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        grammar_sandbox().start()  # its worker processes, before the first constrained request
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
