"""LLMEngine: the engine core run in-process behind the front end's admission and output processing.

Requests in (text or token ids), one scheduled step at a time, RequestOutputs out. The same
`EngineCore` runs in a process of its own under `llmpipe serve`; this is the offline front end:
`Admission` checks and tokenizes a prompt, the core steps, and the `OutputProcessor` turns its
token ids into text, applies stop strings and times the request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, ContextManager

import torch

from llmpipe.config import EngineConfig
from llmpipe.engine.admission import Admission, PromptInput
from llmpipe.engine.encoder_core import engine_core
from llmpipe.engine.core_client import ThreadCoreClient
from llmpipe.engine.core_messages import EngineStats, SpecDecodeStats
from llmpipe.engine.output_processor import OutputProcessor
from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.kv_cache.kinds import BlockTable
from llmpipe.lora.request import LoRARequest
from llmpipe.outputs import RequestOutput
from llmpipe.pooling.prompts import SentencePrompts
from llmpipe.pooling.rerank_prompt import ScorePrompts
from llmpipe.pooling_params import PoolingParams
from llmpipe.sampling_params import SamplingParams

__all__ = ["EngineStats", "LLMEngine", "PromptInput", "SpecDecodeStats"]


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True):
        self.core = engine_core(config, progress)
        self.tokenizer = self.core.checkpoint.tokenizer
        info = self.core.info(0)
        self.admission = Admission.serving(self.tokenizer, info)
        self.score_prompts = ScorePrompts(info.task, not info.generates, self.tokenizer, info.max_model_len,
                                          self.checkpoint_path.name)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.sentence_prompts = SentencePrompts.read(self.checkpoint_path)
        self._server: ThreadCoreClient | None = None

    # What benchmarks, diagnosis and evaluation read of the engine (the core's other state: `core`).
    config = property(lambda self: self.core.config)  # as the core resolved it
    model = property(lambda self: self.core.model)
    weight_bytes = property(lambda self: self.core.weight_bytes)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    kv_layout = property(lambda self: self.core.kv_layout)

    def thread_client(self, before_step: Callable[[], None] | None = None) -> ThreadCoreClient:
        """This engine's core, stepped on a thread of its own for an API server in this process. While that thread
        runs, this engine takes no requests of its own (add_request, step raise): the thread steps every request in
        the core, and would take their outputs."""
        self._server = ThreadCoreClient(self.core, before_step)
        return self._server

    def _check_not_served(self) -> None:
        if self._server is not None and self._server.alive:
            raise LLMPipeError("this engine is served by an API server on a thread of this process: send requests to "
                               "that server, or use another LLM")

    def rank_memory(self) -> list | None:
        """Each tensor-parallel rank's memory (None on one process)."""
        rank_memory = getattr(self.core.runner, "rank_memory", None)
        return rank_memory() if rank_memory is not None else None

    checkpoint_path = property(lambda self: self.core.checkpoint.path)
    file_bytes = property(lambda self: self.core.checkpoint.file_bytes)

    def close(self) -> None:
        self.core.close()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def kv_bytes_per_sequence(self, num_tokens: int) -> int:
        """Bytes of KV blocks one sequence of num_tokens computed tokens holds (window groups capped), and of its
        states where layers keep one per sequence."""
        layout = self.core.kv_layout
        return layout.blocks_held(num_tokens, self.config.block_size) * self.core.block_bytes + layout.state_bytes()

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams,
                    lora_request: LoRARequest | None = None) -> None:
        """A generation request (SamplingParams) or a pooling one (PoolingParams: it ends with its prompt);
        `lora_request`: the LoRA adapter it runs under, loaded first if it is not yet."""
        self._check_not_served()
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            self.add_lora(lora_request)
        lora_name = lora_request.lora_name if lora_request is not None else None
        text, request = self.admission.request(request_id, prompt, params, lora_name)
        self.core.add_request(request)
        self.output_processor.add(request_id, text, request.prompt_token_ids, request.params)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras), with enable_lora ----

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter unless one of its name is loaded (from the same path): True if it loaded now.
        Raises what a bad adapter, a rank above max_lora_rank or full slots (max_loras) raise."""
        loaded = self.core.loras.paths.get(lora_request.lora_name)
        if loaded is not None:
            if lora_request.lora_path and Path(loaded) != Path(lora_request.lora_path):
                raise InvalidRequestError(f"a LoRA adapter named {lora_request.lora_name!r} is loaded from {loaded}; "
                                          "remove it before loading another under that name", param="lora_request")
            return False
        if not lora_request.lora_path:
            raise InvalidRequestError(f"LoRA adapter {lora_request.lora_name!r} is not loaded and the request gives no "
                                      "lora_path", param="lora_request")
        self.core.loras.load(lora_request.lora_name, lora_request.lora_path)
        return True

    def remove_lora(self, lora: str | LoRARequest) -> bool:
        """Unload an adapter (by name or its LoRARequest); refused while requests in flight use it."""
        name = lora.lora_name if isinstance(lora, LoRARequest) else lora
        in_flight = sum(1 for r in self.core.requests.values() if r.sequences[0].lora_name == name)
        self.core.loras.unload(name, in_flight)
        return True

    def list_loras(self) -> dict[str, str]:
        """The adapters loaded: name → path."""
        return self.core.loras.listing() or {}

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks at once."""
        self.output_processor.abort(request_id)
        self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; return the output so far of every request it advanced."""
        self._check_not_served()
        outputs, aborts = self.output_processor.process(self.core.step())
        for request_id, index in aborts:
            self.core.abort(request_id, index)
        return outputs

    def score(self, token_ids: list[int], last_only: bool = False, lora_name: str | None = None) -> torch.Tensor:
        """Logits at every position of token_ids (or the last), computed from scratch (evaluation, tests),
        under a loaded LoRA adapter if `lora_name` names one."""
        if lora_name is None:
            return self.core.score(token_ids, last_only)
        return self.core.score(token_ids, last_only, lora_name)

    def scratch_blocks(self, token_ids: list[int]) -> ContextManager[list[BlockTable]]:
        """A block table for token_ids outside the scheduler (scoring, calibration), freed on exit."""
        return self.core.scratch_blocks(token_ids)
