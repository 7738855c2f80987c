"""Executor: the model side of the engine, as vLLM's executor and its workers. It loads the checkpoint,
sizes and allocates the KV pool, and computes each scheduled batch: one forward pass on the runner
(in this process, or rank 0 of a tensor-parallel group), then its TokenSampler over the logits.
The core hands it a SchedulerOutput and gets a ModelOutput back.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from llmpipe.config import EngineConfig
from llmpipe.kv_cache.kinds import BlockTable
from llmpipe.engine.block_manager import BlockTransfer
from llmpipe.engine.kv_pool import plan_kv_pool
from llmpipe.engine.model_runner import ModelRunner, Runner
from llmpipe.engine.scheduler import SchedulerOutput
from llmpipe.engine.step_size import step_tokens
from llmpipe.engine.model_output import ModelOutput
from llmpipe.engine.pooler import build_pooler, resolve_task
from llmpipe.engine.token_sampler import TokenSampler
from llmpipe.errors import UnsupportedModelError
from llmpipe.kernels import huge_pages
from llmpipe.loader import load_checkpoint
from llmpipe.loader.memory_check import auto_kv_pool, available_bytes, check_fits
from llmpipe.lora.manager import LoRAManager
from llmpipe.models import load_model, resident_bytes
from llmpipe.models.registry import family_of

logger = logging.getLogger(__name__)


class Executor:
    def __init__(self, config: EngineConfig, progress: bool = True):
        """Resolves `config` in place: the checkpoint's model_config, the step's max_num_batched_tokens, an "auto"
        kv_cache_memory, and max_model_len capped to what the pool holds."""
        checkpoint = load_checkpoint(config.model)
        family_of(checkpoint.config.architecture).check_engine_options(config)
        if config.disable_sliding_window:  # every layer attends to (and caches) all tokens
            checkpoint.config = replace(checkpoint.config, sliding_window=None)
        config.model_config = checkpoint.config
        config.max_num_batched_tokens = step_tokens(config.max_num_batched_tokens, checkpoint.config)
        config.task = resolve_task(config.task, checkpoint.path.name, checkpoint.config.embedding_only)
        if config.task == "score" and config.tensor_parallel_size > 1:  # the head's logits are a collective of every rank
            raise UnsupportedModelError(f"{checkpoint.path.name}: a reranker's scores are not served under tensor parallelism")
        self.config, self.checkpoint = config, checkpoint
        self.eos_token_ids = set(checkpoint.config.eos_token_ids)
        if checkpoint.tokenizer is not None and checkpoint.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(checkpoint.tokenizer.eos_token_id)
        # This process's share (rank 0's under tensor parallelism); a block count is sized after the model.
        weight_bytes, available = checkpoint.file_bytes // config.tensor_parallel_size, available_bytes()
        if config.kv_cache_memory == "auto":
            config.kv_cache_memory = auto_kv_pool(weight_bytes, available)
        check_fits(str(config.model), weight_bytes, 0 if config.max_num_blocks else config.kv_cache_memory, available)
        if config.tensor_parallel_size > 1:  # rank 0's shard here; the runner starts the other ranks
            from llmpipe.distributed.executor import TensorParallelExecutor

            self.runner: Runner = TensorParallelExecutor(checkpoint, config, progress)
            self.model = self.runner.model
        else:
            self.model = load_model(checkpoint, config, progress)
        # Per rank under tensor parallelism: self.model.config has rank 0's KV heads (the most).
        self.kv_layout, self.block_bytes, self.num_blocks = plan_kv_pool(config, self.model)
        self._set_max_model_len(self.kv_layout.max_tokens(
            self.num_blocks, config.block_size, config.max_num_batched_tokens, checkpoint.config.max_position_embeddings
        ))
        if config.tensor_parallel_size > 1:
            self.runner.start(self.num_blocks, self.kv_layout)
        else:
            self.runner = ModelRunner(self.model, config, self.num_blocks, self.kv_layout)
            if config.enable_lora:  # slots for max_loras adapters; each loads at start or at run time (core.loras)
                self.runner.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.torch_dtype)
        self.sampler: TokenSampler | None = None  # the core's, which knows the requests' grammars
        self.pooler = build_pooler(self.model, checkpoint, config.task)

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """The batch's sampled tokens, and the results of the pooling requests whose prompts it completed."""
        result = self.runner.execute(batch)
        output = self.sampler.sample(batch, result.logits)
        chunks = batch.pooling_chunks()
        if chunks:
            output.pooled, failed = self.pooler.pool(chunks, result.pooled)
            output.failed.update(failed)
        return output

    def score(self, token_ids: list[int], block_tables: list[BlockTable], last_only: bool = False,
              lora_name: str | None = None) -> torch.Tensor:
        if lora_name is not None:  # a ModelRunner's (LoRA runs on one process)
            return self.runner.score(token_ids, block_tables, last_only, lora_name=lora_name)
        return self.runner.score(token_ids, block_tables, last_only)

    def copy_blocks(self, copies: list[BlockTransfer]) -> None:
        self.runner.copy_blocks(copies)

    @property
    def weight_bytes(self) -> int:
        """Resident weights: parameters and persistent buffers (quantized weights, their scales), each
        once; under tensor parallelism, rank 0's shard (`runner.rank_memory()` has every rank's)."""
        return resident_bytes(self.model)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes a token adds to a sequence's cache once it is longer than every window."""
        return self.kv_layout.growth_bytes_per_token(self.runner.kv_cache.bytes_per_token)

    def fault_in_kv_cache(self) -> None:
        """The KV cache's pages taken now, before a server's first request (huge_pages.fault_in); the
        ranks of a tensor-parallel runner keep theirs lazy."""
        for tensor in getattr(self.runner.kv_cache, "tensors", ()):
            huge_pages.fault_in(tensor)

    def close(self) -> None:
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _set_max_model_len(self, pool_tokens: int) -> None:
        model_len = self.config.model_config.max_position_embeddings
        wanted = min(self.config.max_model_len or model_len, model_len)
        if wanted > pool_tokens:
            logger.warning("max_model_len %d capped to the KV cache's %d tokens", wanted, pool_tokens)
        self.config.max_model_len = min(wanted, pool_tokens)
