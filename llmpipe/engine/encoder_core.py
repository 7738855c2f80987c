"""EncoderCore: the engine core of an encoder (BERT, EmbeddingGemma, a BERT cross-encoder), in place of
EngineCore when `llmpipe.pooling.is_encoder` claims the checkpoint.

An encoder attends both ways over its whole input, so it has no KV cache, no chunks and no sampling:
each step takes the waiting pooling requests in arrival order, as many as max_num_seqs and the token
budget (max_num_batched_tokens, counted padded) allow, runs one forward over them
(`Encoder.embed` / `Encoder.score`), and ends each with its result. The same messages in and out as
EngineCore (EngineCoreRequest, EngineCoreOutputs), so the offline LLM and `llmpipe serve`'s core
process run either.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from llmpipe.config import EngineConfig
from llmpipe.engine.admission import Admission
from llmpipe.engine.core import EngineCore
from llmpipe.engine.core_messages import CoreInfo, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineStats
from llmpipe.engine.step_size import STEP_TOKENS
from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.aliases import resolve_model
from llmpipe.lora.served import ServedAdapters
from llmpipe.models import resident_bytes
from llmpipe.loader import load_checkpoint
from llmpipe.pooling import Encoder, is_encoder, load_encoder
from llmpipe.pooling.inputs import load_tokenizer
from llmpipe.pooling.pipeline import transformer_dir
from llmpipe.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EncoderCheckpoint:
    """What the front end reads of a core's checkpoint."""

    tokenizer: Tokenizer
    path: Path
    file_bytes: int


class EncoderCore:
    kv_layout = None
    eos_token_ids: set[int] = set()
    loras = ServedAdapters(None)  # no LoRA: a request naming an adapter is refused

    def __init__(self, config: EngineConfig, *, progress: bool = True):
        config = replace(config)  # resolved here: the caller's stays as given
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model(config.model)
        self.encoder: Encoder = load_encoder(path)
        if config.task not in ("auto", self.encoder.task):
            raise UnsupportedModelError(f"{path.name}: an encoder serves its own head (task {self.encoder.task!r}), "
                                        f"not task {config.task!r}")
        if config.enable_lora:
            raise UnsupportedModelError(f"{path.name}: an encoder serves no LoRA adapters (enable_lora)")
        config.task = self.encoder.task
        config.max_model_len = min(config.max_model_len or self.encoder.max_len, self.encoder.max_len)
        config.max_num_batched_tokens = config.max_num_batched_tokens or STEP_TOKENS
        self.config = config
        self.model: nn.Module = self.encoder.model
        files = [f for f in path.rglob("*.safetensors")] if path.is_dir() else [path]
        self.checkpoint = EncoderCheckpoint(self.encoder.tokenizer, path, sum(f.stat().st_size for f in files))
        self.waiting: dict[str, EngineCoreRequest] = {}  # in arrival order
        self.admission = Admission.serving(None, self.info(0))
        self.separator = _pair_separator(self.encoder) if self.encoder.task == "score" else None
        self.num_prefill_tokens = 0

    requests = property(lambda self: self.waiting)  # what the core loop aborts when it stops

    @property
    def weight_bytes(self) -> int:
        return resident_bytes(self.model)

    def info(self, pid: int) -> CoreInfo:
        embedding_size = self.encoder.dimensions if self.encoder.task == "embed" else None
        return CoreInfo(self.config.model, self.config.max_model_len, self.encoder.vocab_size, (), self.weight_bytes, pid,
                        self.config.task, embedding_size, generates=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.admission.check(request.prompt_token_ids, request.params, generates=False)
        self.admission.check_task(request.pooling)
        self.waiting[request.request_id] = request

    def abort(self, request_id: str, index: int | None = None) -> None:
        self.waiting.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def fault_in(self) -> None:
        """Nothing to take ahead of the first request: an encoder keeps no cache."""

    def close(self) -> None:
        pass

    def step(self) -> EngineCoreOutputs:
        batch = self._schedule()
        results = self._compute(batch)
        now = time.perf_counter()
        outputs = [EngineCoreOutput(r.request_id, 0, [], finish_reason="stop", first_scheduled_time=now, pooled=result)
                   for r, result in zip(batch, results)]
        return EngineCoreOutputs(outputs, now)

    def step_guarded(self) -> EngineCoreOutputs:
        """A step whose fault fails the requests it took, not the server (EngineCore.step_guarded)."""
        taken = list(self.waiting)
        try:
            return self.step()
        except Exception as err:
            logger.exception("encoder step failed; failing its requests")
            error = f"the engine's step failed ({type(err).__name__})"
            failed = [rid for rid in taken if rid not in self.waiting]
            return EngineCoreOutputs([EngineCoreOutput(rid, 0, [], finish_reason="error", error=error) for rid in failed],
                                     time.perf_counter())

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=len(self.waiting), kv_cache_usage=0.0, num_blocks=0,
                           num_free_blocks=0, peak_blocks_in_use=0, kv_bytes_per_token=0, prefix_cache_queries=0,
                           prefix_cache_hits=0, num_preemptions=0, num_prefill_tokens=self.num_prefill_tokens,
                           num_generation_tokens=0)

    def _schedule(self) -> list[EngineCoreRequest]:
        """The first waiting requests whose padded batch fits the token budget (at least one)."""
        batch: list[EngineCoreRequest] = []
        longest = 0
        for request in list(self.waiting.values())[: self.config.max_num_seqs]:
            longest = max(longest, len(request.prompt_token_ids))
            if batch and longest * (len(batch) + 1) > self.config.max_num_batched_tokens:
                break
            batch.append(self.waiting.pop(request.request_id))
        self.num_prefill_tokens += sum(len(r.prompt_token_ids) for r in batch)
        return batch

    def _compute(self, batch: list[EngineCoreRequest]) -> list[list[float]]:
        ids = [r.prompt_token_ids for r in batch]
        if self.encoder.task == "score":
            scores = self.encoder.score([(row, self._token_types(row)) for row in ids])
            return [[score] for score in scores.tolist()]
        vectors = self.encoder.embed(ids)
        return [_finished(vector, r.pooling.dimensions, r.pooling.normalize) for vector, r in zip(vectors, batch)]

    def _token_types(self, ids: list[int]) -> list[int]:
        """A pair's segments: 0 through the first separator, 1 after (BERT's rule; the front end sends ids)."""
        end = ids.index(self.separator) + 1 if self.separator in ids else len(ids)
        return [0] * end + [1] * (len(ids) - end)


def _finished(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` (Matryoshka), normalized unless asked not to (a model whose pipeline normalizes
    is normalized already)."""
    vector = vector[:dimensions]
    return (nn.functional.normalize(vector, dim=-1) if normalize else vector).tolist()


def _pair_separator(encoder: Encoder) -> int:
    """The token that closes a pair's first segment, read off the tokenizer's own pair template."""
    ids, types = encoder.encode_pair("a", "b")
    return ids[types.index(1) - 1]


def engine_core(config: EngineConfig, progress: bool = True) -> EngineCore | EncoderCore:
    """The core that serves config.model: an EncoderCore for an encoder's directory, else an EngineCore."""
    if is_encoder(resolve_model(config.model)):
        return EncoderCore(config, progress=progress)
    return EngineCore(config, progress=progress)


def serving_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer a front end in another process encodes config.model's requests with (the core loads the weights)."""
    path = resolve_model(model)
    if is_encoder(path):
        return load_tokenizer(transformer_dir(path))
    return load_checkpoint(model).tokenizer
