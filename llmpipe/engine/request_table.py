"""RequestTable: the requests the core holds, by id, until every sample of each has ended, and the
outputs a step's advanced samples send to the front end."""

from __future__ import annotations

import time
from typing import Callable

import torch

from llmpipe.engine.core_messages import EngineCoreOutput, EngineCoreRequest
from llmpipe.engine.scheduler import SchedulerOutput
from llmpipe.engine.sequence import Request, Sequence
from llmpipe.errors import InvalidRequestError


class RequestTable(dict[str, Request]):
    def __init__(self, device: str, on_finished: Callable[[str], None]):
        super().__init__()
        self.device = device
        self.on_finished = on_finished  # a request id whose samples have all ended and been sent

    def new(self, request: EngineCoreRequest, cache_salt: str | None = None) -> Request:
        """The request with its n samples, each with its own seeded generator (not yet in the table):
        sample 0 runs first, the others start from its prompt once it is computed. `cache_salt`: what its
        prefix-cache hashes are seeded with, where the core combined the request's with its adapter's."""
        if request.request_id in self:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        token_ids, params = request.prompt_token_ids, request.params
        sequences = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
            seq = Sequence(request.request_id, index, list(token_ids), params, generator)
            seq.new_logprobs = [] if params.logprobs is not None else None
            seq.pooling = request.pooling
            seq.cache_salt = cache_salt if cache_salt is not None else request.cache_salt
            seq.lora_name = request.lora_name
            sequences.append(seq)
        sequences[0].siblings = sequences[1:]
        return Request(request.request_id, token_ids, params, sequences)

    def note_scheduled(self, batch: SchedulerOutput) -> None:
        now = time.perf_counter()
        for seq in [item.seq for item in batch.prefills] + list(batch.pooling_rows):
            request = self[seq.request_id]
            request.first_scheduled_time = request.first_scheduled_time or now

    def outputs(self, seqs: list[Sequence]) -> list[EngineCoreOutput]:
        """What each sample gained since its last output; requests now ended leave the table."""
        outputs = []
        for seq in seqs:
            request = self.get(seq.request_id)
            if request is None:
                continue
            first_scheduled = None
            if not request.scheduled_sent:
                request.scheduled_sent, first_scheduled = True, request.first_scheduled_time
            outputs.append(seq.take_output(first_scheduled))
        for output in outputs:
            request = self.get(output.request_id)
            if request is not None and request.finished:
                self.forget(output.request_id)
        return outputs

    def forget(self, request_id: str) -> None:
        del self[request_id]
        self.on_finished(request_id)
