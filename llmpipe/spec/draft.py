"""Draft-model proposer: a smaller or quantized model sharing the target's tokenizer decodes k
tokens per sequence, batched across sequences, with its own paged KV cache.

Each target sequence has a shadow sequence in the draft's cache. Before proposing, the shadow
takes the target's tokens; its cache stays valid up to the first position where they differ from
what it computed (the draft tokens the target rejected), so only the tokens the target added are
prefilled again. A shadow whose cache cannot grow proposes nothing that step.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from llmpipe.config import EngineConfig, ModelConfig
from llmpipe.engine.block_manager import BlockManager
from llmpipe.kv_cache.kinds import BlockTable
from llmpipe.engine.kv_pool import plan_kv_pool
from llmpipe.engine.model_runner import ModelRunner
from llmpipe.engine.scheduler import ScheduledChunk, SchedulerOutput
from llmpipe.engine.sequence import Sequence
from llmpipe.errors import LLMPipeError
from llmpipe.layers.sampler import SamplingRow, adjusted_logits, argmax_rows, distribution, draw
from llmpipe.loader import load_checkpoint
from llmpipe.models import load_model
from llmpipe.models.registry import family_of
from llmpipe.spec.proposal import Proposal

logger = logging.getLogger(__name__)

RowFor = Callable[[Sequence, list[int]], SamplingRow]  # the target's sampling row after some draft tokens


@dataclass
class Shadow:
    seq: Sequence  # the draft's copy: the target's tokens plus its own guesses
    synced: int = 0  # target tokens it held at the last sync; beyond them it holds guesses


class DraftProposer:
    def __init__(self, config: EngineConfig, target: ModelConfig, row_for: RowFor, progress: bool = True):
        draft_config = dataclasses.replace(
            config, model=config.speculative_model, quantization=config.speculative_quantization,
            dtype="auto" if config.speculative_quantization == "auto" else config.dtype,  # auto: a GGUF's Q4/Q8 as stored
            speculative_method=None, speculative_model=None, model_config=None, max_num_blocks=None,
            tensor_parallel_size=1,  # the draft runs whole on rank 0
        )
        checkpoint = load_checkpoint(draft_config.model)
        if checkpoint.config.vocab_size != target.vocab_size:
            raise LLMPipeError(
                f"speculative_model {config.speculative_model!r} has a vocabulary of {checkpoint.config.vocab_size} "
                f"tokens, the target {target.vocab_size}: the draft must share the target's tokenizer"
            )
        family_of(checkpoint.config.architecture).check_engine_options(draft_config)
        draft_config.model_config = checkpoint.config
        self.model = load_model(checkpoint, draft_config, progress)
        layout, _, num_blocks = plan_kv_pool(draft_config, self.model)
        self.blocks = BlockManager(num_blocks, config.block_size, [g.spec for g in layout.groups], False)
        self.runner = ModelRunner(self.model, draft_config, num_blocks, layout)
        self.max_len = checkpoint.config.max_position_embeddings
        self.row_for = row_for
        self.shadows: dict[Sequence, Shadow] = {}

    def propose(self, seqs: list[Sequence], limits: list[int]) -> dict[Sequence, Proposal]:
        active = {}
        for seq, k in zip(seqs, limits):
            k = min(k, self.max_len - seq.num_tokens)
            if k >= 1 and self._prepare_shadow(seq, k):
                active[seq] = k
        drafted: dict[Sequence, list[int]] = {seq: [] for seq in active}
        probs: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq in active}
        while active:
            self._step(active, drafted, probs)
            active = {seq: k for seq, k in active.items() if len(drafted[seq]) < k}
        return {
            seq: Proposal(tokens, torch.stack(probs[seq]) if probs[seq] else None)
            for seq, tokens in drafted.items()
        }

    def prefill(self, seqs: list[Sequence]) -> None:
        ready = [seq for seq in seqs if seq.num_tokens < self.max_len and self._prepare_shadow(seq, 1)]
        if ready:
            self._forward([self.shadows[seq].seq for seq in ready])

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq, None)
        if shadow is not None:
            self.blocks.free_sequence(shadow.seq)

    def _prepare_shadow(self, seq: Sequence, k: int) -> bool:
        """Sync the shadow with seq and reserve its blocks for this proposal (False: no room)."""
        shadow = self.shadows.get(seq)
        if shadow is None:
            copy = Sequence(seq.request_id, seq.index, [], seq.params, None)
            copy.block_tables = [BlockTable() for _ in self.blocks.specs]
            shadow = self.shadows[seq] = Shadow(copy)
        draft, tokens = shadow.seq, seq.all_token_ids
        valid = min(draft.num_computed_tokens, len(tokens))
        for position in range(shadow.synced, valid):  # guesses the target did not keep end the valid cache
            if draft.all_token_ids[position] != tokens[position]:
                valid = position
                break
        draft.all_token_ids[shadow.synced :] = tokens[shadow.synced :]
        draft.num_computed_tokens, shadow.synced = valid, len(tokens)
        # The k-th guess is never fed back, so the cache grows by the uncomputed tokens + k - 1.
        needed = len(tokens) - valid + k - 1
        self.blocks.free_unreachable(draft)
        if not self.blocks.can_reserve(draft, needed):
            return False
        self.blocks.reserve(draft, needed)
        return True

    def _forward(self, shadows: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute every shadow's uncomputed tokens; logits at each one's last token, in the returned order."""
        batch = SchedulerOutput(
            [s for s in shadows if not s.in_prefill],
            [ScheduledChunk(s, s.num_tokens - s.num_computed_tokens) for s in shadows if s.in_prefill],
        )
        logits = self.runner.execute(batch).logits  # rows: decodes, then the chunks (each ends its prefill)
        for shadow in shadows:
            shadow.num_computed_tokens = shadow.num_tokens
        return logits, batch.decodes + [chunk.seq for chunk in batch.prefills]

    def _step(self, active: dict[Sequence, int], drafted: dict[Sequence, list[int]], probs: dict) -> None:
        """One draft forward pass: every active shadow's uncomputed tokens in, one guess each out."""
        logits, order = self._forward([self.shadows[seq].seq for seq in active])
        targets = {self.shadows[seq].seq: seq for seq in active}
        rows = [self.row_for(targets[s], drafted[targets[s]]) for s in order]
        adjusted = adjusted_logits(logits, rows)
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        q_row = {i: j for j, i in enumerate(sampled)}
        q = distribution(adjusted[sampled], [rows[i] for i in sampled]) if sampled else None
        argmax = argmax_rows(adjusted).tolist()
        for i, shadow in enumerate(order):
            seq = targets[shadow]
            if rows[i].params.greedy:
                token = argmax[i]
            else:
                dist = q[q_row[i]]
                token = draw(dist, rows[i].generator)
                probs[seq].append(dist)
            drafted[seq].append(token)
            shadow.all_token_ids.append(token)
