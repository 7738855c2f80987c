"""One request's engine requests as one reply: a chat completion's (one prompt), or a completions
request's, however many prompts it sends.

Each prompt of the body is an engine request of its own; the reply lists their choices indexed
`prompt_index * n + sample_index` (OpenAI's order), sums their usage, and streams their chunks as
they come. `echo` puts the prompt before each choice's text, token by token in its logprobs (the
first prompt token's are null: nothing comes before it), as OpenAI's legacy completions and vLLM do.
Choices also carry vLLM's `prompt_logprobs` when the request asked for them (a chat reply carries
them once, at its top level, as vLLM's does).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from llmpipe.errors import LLMPipeError
from llmpipe.outputs import Logprob, RequestOutput
from llmpipe.server.async_engine import AsyncEngine, RequestStream
from llmpipe.server.errors import llmpipe_error_body
from llmpipe.server.openai_format import CompletionFormat, Format, StreamState, stream_chunks, usage
from llmpipe.pooling_params import PoolingParams
from llmpipe.sampling_params import SamplingParams

MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


@dataclass
class RequestBatch:
    streams: list[RequestStream]
    fmt: Format
    n: int
    with_prompt_logprobs: bool  # the requests compute prompt logprobs (asked for, or for echo's logprobs)
    echo_texts: dict[int, str] = field(default_factory=dict)  # prompt index → its echoed text, decoded once

    @classmethod
    async def start(cls, engine: AsyncEngine, requests: list[tuple[dict, SamplingParams | PoolingParams]],
                    fmt: Format | None, lora_name: str | None = None):
        """Queue every prompt's request (under LoRA adapter `lora_name`, if given), the body counted once
        against the waiting queue's cap; if one is refused, those already queued are aborted. (Pooling
        requests have no format: each ends with its result.)"""
        streams: list[RequestStream] = []
        engine.check_capacity()  # once per body: a request of 1,000 inputs is admitted whole or not at all
        try:
            for prompt, params in requests:
                streams.append(await engine.add(prompt, params, admitted=True, lora_name=lora_name))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        params = requests[0][1]
        if isinstance(params, PoolingParams):
            return cls(streams, fmt, 1, False)
        return cls(streams, fmt, params.n, params.prompt_logprobs is not None)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    def body(self, finals: list[RequestOutput]) -> dict:
        choices = [choice for p, output in enumerate(finals) for choice in self._choices(p, output)]
        reply = {**self.fmt._envelope(self.fmt.object, choices), "usage": summed_usage(finals),
                 "llmpipe_timing": _timing(finals)}
        if self.with_prompt_logprobs and not self._per_choice:
            reply["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_logprobs)
        return reply

    @property
    def _per_choice(self) -> bool:
        """Whether prompt logprobs ride on each choice (completions) or once on the reply (chat)."""
        return isinstance(self.fmt, CompletionFormat)

    def _choices(self, p: int, output: RequestOutput) -> list[dict]:
        shown = self._shown(p, output) or output
        return [self._indexed(p, self.fmt.full_choice(choice), output, self.with_prompt_logprobs)
                for choice in shown.outputs]

    def _indexed(self, p: int, choice: dict, output: RequestOutput, with_prompt_logprobs: bool) -> dict:
        """choice as the reply lists it: indexed among all prompts' choices, and its prompt logprobs."""
        choice["index"] += p * self.n
        if with_prompt_logprobs and self._per_choice:
            choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
        return choice

    def _shown(self, p: int, output: RequestOutput) -> RequestOutput | None:
        """Prompt p's output as the client sees it (echoed if asked); None while its prompt logprobs
        are still coming (they arrive whole once the prompt is computed)."""
        if self.with_prompt_logprobs and output.prompt_logprobs is None:
            return None
        if not (isinstance(self.fmt, CompletionFormat) and self.fmt.echo):
            return output
        if p not in self.echo_texts:  # a token-id prompt is decoded once, not at every step of its stream
            self.echo_texts[p] = echo_text(output, self.fmt)
        return echoed(output, self.echo_texts[p])

    async def chunks(self, include_usage: bool) -> AsyncIterator[dict]:
        """Every prompt's chunks as its outputs come, then (include_usage) one usage chunk for all."""
        sent = [[StreamState() for _ in range(self.n)] for _ in self.streams]
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        try:
            async for p, output in _merged(self.streams):
                finals[p] = output if output.finished else None
                shown = self._shown(p, output)
                if shown is None:
                    continue
                fresh = {i for i, state in enumerate(sent[p]) if not state.started}
                chunks = stream_chunks(self.fmt, shown, sent[p])
                for chunk in chunks:
                    choice = chunk["choices"][0]  # a choice's first chunk carries its prompt logprobs
                    self._indexed(p, choice, output, self.with_prompt_logprobs and choice["index"] in fresh)
                    if include_usage:
                        chunk["usage"] = None
                if output.finished and not include_usage and chunks:
                    chunks[-1]["llmpipe_timing"] = output.metrics.timing_breakdown()
                for chunk in chunks:
                    yield chunk
            if include_usage:
                yield {**self.fmt.chunk([]), "usage": summed_usage(finals), "llmpipe_timing": _timing(finals)}
        except LLMPipeError as err:  # the engine failed a request, or the server is shutting down
            yield llmpipe_error_body(err)


def echo_text(output: RequestOutput, fmt: CompletionFormat) -> str:
    """The text echo puts first: the prompt as sent, or its token ids decoded."""
    if output.prompt is not None:
        return output.prompt
    return fmt.decode(output.prompt_token_ids) if fmt.decode else ""


def echoed(output: RequestOutput, text: str) -> RequestOutput:
    """output with its prompt (`text`) before each choice: text, token ids and (with logprobs) their logprobs."""
    prompt_ids = output.prompt_token_ids
    choices = []
    for choice in output.outputs:
        logprobs = choice.logprobs
        if logprobs is not None and output.prompt_logprobs is not None:
            logprobs = list(output.prompt_logprobs) + logprobs
        choices.append(replace(choice, text=text + choice.text, token_ids=prompt_ids + choice.token_ids, logprobs=logprobs))
    return replace(output, outputs=choices)


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if entry is None else {
        str(tid): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for tid, lp in entry.items()
    } for entry in entries]


def summed_usage(outputs: list[RequestOutput | None]) -> dict:
    parts = [usage(output) for output in outputs if output is not None]
    total = {key: sum(part[key] for part in parts) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(part["prompt_tokens_details"]["cached_tokens"] for part in parts)
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}}


def _timing(outputs: list[RequestOutput | None]) -> dict | list[dict | None]:
    """One prompt's timing breakdown; a list of them for a batch of prompts."""
    timings = [None if output is None else output.metrics.timing_breakdown() for output in outputs]
    return timings[0] if len(timings) == 1 else timings


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; a stream's error is raised."""
    if len(streams) == 1:  # the common case needs no tasks
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((p, output))
        except BaseException as err:
            queue.put_nowait((p, err))
        queue.put_nowait((p, None))

    tasks = [asyncio.ensure_future(pump(p, stream)) for p, stream in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            p, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield p, item
    finally:
        for task in tasks:
            task.cancel()
