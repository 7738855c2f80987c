"""AsyncEngine: the API server's front end of the engine core; each request reads its outputs from an
asyncio queue.

On the event loop it checks admission, sends token ids to the core (`core_client`: a process of
its own under `llmpipe serve`, a thread for an in-process `LLM`), and turns each step's token ids
into RequestOutputs with the `OutputProcessor` (detokenizing, stop strings, timing). If the core
dies, every request in flight fails with an error and `alive` turns False (/health answers 503).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import AsyncIterator, Callable

from llmpipe.engine.admission import Admission, PromptInput
from llmpipe.engine.core_messages import EngineStats
from llmpipe.engine.core_client import CoreClient
from llmpipe.engine.core_messages import EngineCoreOutputs
from llmpipe.engine.output_processor import OutputProcessor
from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.lora.served import AdapterNotFoundError
from llmpipe.outputs import RequestOutput
from llmpipe.pooling_params import PoolingParams
from llmpipe.sampling_params import SamplingParams
from llmpipe.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DRAIN_POLL_S = 0.05


class UnavailableError(LLMPipeError):
    """The waiting queue is full, or the server is shutting down (HTTP 503)."""


class RequestFailedError(LLMPipeError):
    """The engine failed this request (a server-side fault, not the client's)."""


class RequestStream:
    """One request's outputs, in order, as the engine produces them."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self.finished = False
        self.num_tokens = 0  # generated tokens already counted (for the metrics)
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        """Free the request's KV blocks at the engine's next turn (a no-op once it finished)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, client: CoreClient, tokenizer: Tokenizer | None, max_waiting: int | None = None) -> None:
        self.client = client
        self.info = client.info
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.stats: EngineStats = client.stats  # the core's latest snapshot (after its latest step)
        self.admission = Admission.serving(tokenizer, client.info)
        # The LoRA adapters the core holds (name → path), kept in step with its answers to load / unload;
        # the input processor reads this same dict. lora_enabled: the core runs with enable_lora.
        self.loras: dict[str, str] = dict(client.info.loras or {})
        self.lora_enabled = client.info.loras is not None
        self.outputs = OutputProcessor(tokenizer)
        # Called with every output the engine hands back, in order (the server's metrics).
        self.on_output: Callable[[RequestStream, RequestOutput], None] | None = None
        # Called once if the core dies unasked (the server exits).
        self.on_core_death: Callable[[str], None] | None = None
        self._streams: dict[str, RequestStream] = {}
        self._unseen: set[str] = set()  # sent, not yet scheduled: waiting
        self._closing = False
        self._dead: str | None = None
        self._started = False
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.client.start(self._on_step, self._on_death)
        self._started = True

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running and stop the core."""
        self._abort_all(UnavailableError("the server is shutting down"))
        await self.client.stop(timeout)

    def drain(self, timeout: float, on_drained: Callable[[], None] | None = None) -> None:
        """Shutdown has begun: refuse new requests (503), give the running ones `timeout` seconds,
        end what is left, then call `on_drained`."""
        self._closing = True
        deadline = self._loop.time() + timeout

        def check() -> None:
            if self._streams and self._loop.time() < deadline:
                self._loop.call_later(DRAIN_POLL_S, check)
                return
            self._abort_all(UnavailableError("the server is shutting down"))
            if on_drained is not None:
                on_drained()

        check()

    def drain_threadsafe(self, timeout: float, on_drained: Callable[[], None] | None = None) -> None:
        self._loop.call_soon_threadsafe(self.drain, timeout, on_drained)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def alive(self) -> bool:
        return self._started and self._dead is None and self.client.alive

    def labelled_stats(self) -> list[tuple[dict[str, str], EngineStats]]:
        """The core's latest stats, or each data-parallel replica's that is up, labelled `replica`."""
        replicas = getattr(self.client, "replica_stats", None)
        if replicas is None:
            return [({}, self.stats)]
        return [({"replica": str(i)}, s) for i, s in enumerate(replicas) if s is not None]

    def check_capacity(self) -> None:
        """UnavailableError unless a new request may queue: the server is up and the waiting queue not full."""
        if self._closing:
            raise UnavailableError("the server is shutting down")
        if self._dead is not None:
            raise UnavailableError(self._dead)
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise UnavailableError(f"the waiting queue is full ({self.max_waiting} requests); retry later")

    @property
    def num_waiting(self) -> int:
        return len(self._unseen)

    async def add(self, prompt: PromptInput, params: SamplingParams | PoolingParams, *,
                  admitted: bool = False, lora_name: str | None = None) -> RequestStream:
        """Queue a generation or pooling request; raises InvalidRequestError (admission) or UnavailableError.
        `admitted`: its body already passed `check_capacity` (the queue cap counts bodies, not their prompts);
        `lora_name`: the loaded LoRA adapter it runs under (None: the base model)."""
        if not admitted:
            self.check_capacity()
        if lora_name is not None and lora_name not in self.loras:
            raise AdapterNotFoundError(lora_name)
        request_id = f"req-{next(self._ids)}"
        text, request = self.admission.request(request_id, prompt, params, lora_name)
        stream = RequestStream(request_id, self)
        self.outputs.add(request_id, text, request.prompt_token_ids, request.params)
        try:
            self.client.add(request)
        except LLMPipeError as err:
            self.outputs.abort(stream.request_id)
            raise UnavailableError(str(err)) from err
        self._streams[stream.request_id] = stream
        self._unseen.add(stream.request_id)
        return stream

    async def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter into the core (between two of its steps); InvalidRequestError if it cannot."""
        await self._lora("load", name, path)

    async def unload_lora(self, name: str) -> None:
        """Unload one: AdapterNotFoundError (404) for a name not loaded, InvalidRequestError while requests use it."""
        if name not in self.loras:
            raise AdapterNotFoundError(name)
        await self._lora("unload", name)

    async def _lora(self, action: str, name: str, path: str | None = None) -> None:
        if not self.lora_enabled:
            raise InvalidRequestError("this server runs without LoRA: start it with --enable-lora", param="lora_name")
        command = getattr(self.client, "lora", None)
        if command is None:
            raise InvalidRequestError("this server's engine cannot load LoRA adapters at run time", param="lora_name")
        self.check_capacity()
        try:
            result = await command(action, name, path)
        except LLMPipeError as err:  # the core died meanwhile
            raise UnavailableError(str(err)) from err
        self.loras.clear()
        self.loras.update(result.loras)
        if result.status == 404:
            raise AdapterNotFoundError(name)
        if result.status != 200:
            raise InvalidRequestError(result.error or f"the LoRA adapter {name!r} was refused",
                                      param="lora_path" if action == "load" else "lora_name")

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._unseen.discard(request_id)
        if request_id in self.outputs.requests:
            self.outputs.abort(request_id)
            if self._dead is None:
                self.client.abort([(request_id, None)])

    def _abort_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put(error)
            self.abort(stream.request_id)

    def _on_step(self, step: EngineCoreOutputs, stats: EngineStats) -> None:
        self.stats = stats  # before the outputs: a client that saw a token sees its step's stats
        for out in step.outputs:
            self._unseen.discard(out.request_id)
        outputs, aborts = self.outputs.process(step)
        if aborts and self._dead is None:
            self.client.abort(aborts)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if self.on_output is not None:
                self.on_output(stream, output)
            error = _request_error(output)
            stream.put(error or output)
            if output.finished or error:
                del self._streams[output.request_id]

    def _on_death(self, reason: str) -> None:
        self._dead = reason
        self._abort_all(RequestFailedError(f"{reason}; see the server log"))
        if self.on_core_death is not None:
            self.on_core_death(reason)


def _request_error(output: RequestOutput) -> RequestFailedError | None:
    failed = [choice for choice in output.outputs if choice.finish_reason == "error"]
    if output.finished and failed:
        return RequestFailedError(f"{failed[0].error or 'the engine failed this request'}; see the server log")
    return None
