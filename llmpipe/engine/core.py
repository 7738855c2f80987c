"""EngineCore: the model, the KV cache, the scheduler, the executor and the speculative proposer.

Token ids in (`EngineCoreRequest`), token ids out (`EngineCoreOutputs`): text never reaches it.
Each step is vLLM v1's three calls: the scheduler picks a batch (decodes + prefill chunks) under
the token budget; the executor computes it in one forward pass over the paged KV cache and samples
(or verifies drafts), returning a ModelOutput; the scheduler applies that output (appends tokens
under the stop rules, forks n > 1 samples, frees what finished). With speculative decoding on,
the proposer's drafts join the batch between the first two.

The offline `LLM` runs this core in-process; `llmpipe serve` runs it in a process of its own
(`core_process.py`), so the model's compute never contends with HTTP for the GIL.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, ContextManager

import torch

from llmpipe.config import EngineConfig
from llmpipe.engine.admission import Admission
from llmpipe.engine.block_manager import BlockManager
from llmpipe.kv_cache.kinds import BlockTable
from llmpipe.engine.core_messages import (CommandResult, CoreInfo, EngineCoreOutputs, EngineCoreRequest, EngineStats,
                                          LoRACommand, SpecDecodeStats)
from llmpipe.engine.drafter import Drafter
from llmpipe.engine.executor import Executor
from llmpipe.engine.kv_pool import offload_tier
from llmpipe.engine.request_table import RequestTable
from llmpipe.engine.scheduler import Scheduler, SchedulerOutput
from llmpipe.engine.sequence import Sequence
from llmpipe.engine.step_costs import StepCosts
from llmpipe.engine.stop_rules import StopRules
from llmpipe.engine.token_sampler import TokenSampler
from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.lora.adapter import LoRAAdapter
from llmpipe.lora.served import ServedAdapters
from llmpipe.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)
GRAMMAR_WAIT_S = 0.05  # a step with only requests whose grammars compile waits this long at most


class EngineCore:
    # What the engine's users read of the model side: the executor's, one copy.
    checkpoint = property(lambda self: self.executor.checkpoint)
    model = property(lambda self: self.executor.model)
    runner = property(lambda self: self.executor.runner)
    kv_layout = property(lambda self: self.executor.kv_layout)
    block_bytes = property(lambda self: self.executor.block_bytes)
    eos_token_ids = property(lambda self: self.executor.eos_token_ids)

    def __init__(self, config: EngineConfig, *, progress: bool = True):
        config = replace(config)  # resolved here (the checkpoint's config, max_model_len): the caller's stays as given
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.config = config
        self.executor = Executor(config, progress)
        self.loras = ServedAdapters(self.runner.lora if config.enable_lora else None)
        for name, path in config.lora_paths.items():  # --lora-modules: a bad adapter fails the start, in one line
            self.loras.load(name, path)
        specs = [group.spec for group in self.kv_layout.groups]
        self.offload = offload_tier(config, self.checkpoint.path, self.runner, self.kv_layout)
        self.runner.offload = self.offload
        self.block_manager = BlockManager(
            self.executor.num_blocks, config.block_size, specs, config.enable_prefix_caching and config.kv_cache,
            copy_partial_blocks=True, tier=self.offload,
        )
        self.structured = StructuredOutputManager(self.checkpoint.tokenizer, config.model_config.vocab_size,
                                                  self.eos_token_ids)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self._ready, StopRules(config, self.eos_token_ids, self.structured),
                                   keep_kv=config.kv_cache, pool_every_token=self.executor.pooler.reads_every_token,
                                   pool_as_rows=self.kv_layout.state_bytes() == 0)
        self.executor.sampler = TokenSampler(self.structured, self.eos_token_ids)
        self.drafter = Drafter.build(config, self.executor.sampler.sampling_row, progress)
        self.proposer = self.drafter.proposer if self.drafter else None
        self.scheduler.release_hooks += [self.structured.release, self.executor.sampler.release,
                                         self.executor.pooler.release]
        if self.drafter is not None:
            self.scheduler.release_hooks.append(self.drafter.release)
        self.step_costs = StepCosts(config.max_decode_stall, config.max_num_seqs)
        self.admission = Admission.serving(None, self.info(0))
        self.requests = RequestTable(config.device, self.structured.forget_request)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected or the
        interpreter exits); the core cannot step afterwards."""
        self.structured.close()
        if self.offload is not None:
            self.flush_offload()
            self.offload.close()
        self.executor.close()

    def fault_in(self) -> None:
        """The KV cache's pages taken now, before a server's first request."""
        self.executor.fault_in_kv_cache()

    def info(self, pid: int) -> CoreInfo:
        return CoreInfo(
            self.config.model, self.config.max_model_len, self.config.model_config.vocab_size,
            tuple(sorted(self.eos_token_ids)), self.weight_bytes, pid, self.config.task, self.embedding_size,
            not self.config.model_config.embedding_only, self.loras.listing(),
        )

    @property
    def embedding_size(self) -> int:
        """The width of this model's embeddings."""
        return self.executor.pooler.embedding_size

    @property
    def spec_stats(self) -> SpecDecodeStats:
        return self.executor.sampler.spec_stats

    @property
    def weight_bytes(self) -> int:
        return self.executor.weight_bytes

    def stats(self) -> EngineStats:
        blocks, state_bytes = self.block_manager, self.kv_layout.state_bytes()
        per_seq: dict[str, int] = {}
        for seq in self.scheduler.running:
            held = blocks.blocks_held(seq) * self.block_bytes + blocks.states_held(seq) * state_bytes
            per_seq[seq.request_id] = per_seq.get(seq.request_id, 0) + held
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=blocks.usage,
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            peak_blocks_in_use=blocks.peak_blocks_in_use,
            kv_bytes_per_token=self.executor.kv_bytes_per_token,
            prefix_cache_queries=blocks.prefix_queries,
            prefix_cache_hits=blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefill_tokens=self.scheduler.num_prefill_tokens,
            num_generation_tokens=self.scheduler.num_generation_tokens,
            kv_bytes_in_use=(blocks.num_blocks - blocks.num_free_blocks) * self.block_bytes + blocks.states_in_use * state_bytes,
            kv_bytes_per_seq=per_seq,
            spec_decode=replace(self.spec_stats) if self.proposer is not None else None,
            kv_offload=replace(self.offload.stats) if self.offload is not None else None,
        )

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit a request the front end checked (`Admission.prompt`); the same rules are checked
        again here, so a front end that skipped them cannot get a bad id into a batch."""
        self.loras.check(request.lora_name)
        added = self.requests.new(request, self.loras.salt(request.lora_name, request.cache_salt))
        self.admission.check(request.prompt_token_ids, request.params, generates=request.pooling is None)
        self.admission.check_task(request.pooling)
        if request.pooling is not None and request.params.n != 1:
            raise InvalidRequestError("a pooling request has one result (n=1)", param="n")
        self.structured.add_request(request.request_id, request.params)  # compiles off the step
        self.requests[request.request_id] = added
        self.scheduler.add(added.sequences[0])

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or one of its samples) now and free its KV blocks at once."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.sequences:
            if index is None or seq.index == index:
                if not seq.finished:
                    seq.finish("abort")
                self.scheduler.release(seq)
        if request.finished:
            self.requests.forget(request_id)

    def _ready(self, seq: Sequence) -> bool:
        """Whether a waiting sequence may start: its grammar compiled, and its LoRA adapter in a slot (at most
        max_loras adapters run at once; a sequence under another one waits for a running adapter's requests)."""
        if not self.structured.is_ready(seq):
            return False
        return seq.lora_name is None or self.loras.admit(seq.lora_name, self._running_adapters())

    def _running_adapters(self) -> set[str | None]:
        return {seq.lora_name for seq in self.scheduler.running}

    def lora_command(self, command: LoRACommand, read: Callable[[], LoRAAdapter] | None = None) -> CommandResult:
        """Load or unload a LoRA adapter (between steps); unloading one that requests in flight use is refused."""
        in_flight = sum(1 for r in self.requests.values() if r.sequences[0].lora_name == command.name)
        return self.loras.apply(command, in_flight, read)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- stepping: schedule → execute → update from the output ------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedule and run one batch: the progress of every request it advanced."""
        started = time.perf_counter()
        batch = self.scheduler.schedule(self.step_costs.prefill_budget, self.step_costs.pooling_budget)
        if batch.empty:
            return self._idle(batch)
        self.requests.note_scheduled(batch)
        if self.drafter is not None:
            self.drafter.draft(batch, self.scheduler)  # speculative tokens join the batch
        model_output = self.executor.execute(batch)
        advanced = self.scheduler.update_from_output(batch, model_output)
        outputs = EngineCoreOutputs(self.requests.outputs(advanced), time.perf_counter())
        self.step_costs.observe(batch.num_rows, time.perf_counter() - started, decode_only=not batch.prefills)
        if self.offload is not None and not self.scheduler.has_work():
            self.flush_offload()  # the blocks the last step completed, saved before the engine idles
        return outputs

    def flush_offload(self) -> None:
        """Carry out the queued block transfers now (saves to the offload tier among them), not at the next step."""
        self.executor.copy_blocks(self.block_manager.take_block_copies())

    def step_guarded(self) -> EngineCoreOutputs:
        """A step whose batch-level fault fails the requests in flight instead of raising: the
        engine keeps serving the next ones."""
        try:
            return self.step()
        except Exception as err:
            logger.exception("engine step failed; failing the requests in flight")
            outputs = []
            for request_id in list(self.requests):
                for seq in self.requests[request_id].sequences:
                    if not seq.finished:
                        seq.fail(f"the engine's step failed ({type(err).__name__})")
                        outputs.append(seq.take_output())
                self.abort(request_id)
            return EngineCoreOutputs(outputs, time.perf_counter())

    def _idle(self, batch: SchedulerOutput) -> EngineCoreOutputs:
        if batch.num_held:  # as the scheduler saw them: a compile may have finished since
            self.structured.wait_for_compiles(GRAMMAR_WAIT_S)  # nothing else can run meanwhile
        elif self.scheduler.has_work():
            raise LLMPipeError("scheduler made no progress: the KV cache is too small for any waiting request")
        return EngineCoreOutputs([], time.perf_counter())

    # ---- evaluation -----------------------------------------------------------------------

    def score(self, token_ids: list[int], last_only: bool = False, lora_name: str | None = None) -> torch.Tensor:
        """Logits at every position of token_ids (or the last), computed from scratch (evaluation, tests),
        under LoRA adapter `lora_name` if given."""
        self.loras.check(lora_name)
        if not self.loras.admit(lora_name, self._running_adapters()):
            raise InvalidRequestError(f"every LoRA slot (max_loras) holds an adapter of a running request: score "
                                      f"under {lora_name!r} once one finishes", param="lora_name")
        with self.scratch_blocks(token_ids) as block_tables:
            return self.executor.score(token_ids, block_tables, last_only, lora_name)

    def scratch_blocks(self, token_ids: list[int]) -> ContextManager[list[BlockTable]]:
        """A block table for token_ids outside the scheduler (scoring, calibration), freed on exit."""
        return self.block_manager.scratch(token_ids, self.executor.copy_blocks)
