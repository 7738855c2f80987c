"""Drafter: speculative decoding's side of a step. Before the batch is computed, its proposer (n-gram
lookup or a draft model) guesses the next tokens of each decode, capped so that none runs past
max_tokens or the context; the scheduler gives slots to the drafts the cache has blocks for, and
they join the batch, to be verified by the TokenSampler against the target's rows.
"""

from __future__ import annotations

from typing import Callable

from llmpipe.config import EngineConfig
from llmpipe.engine.scheduler import Scheduler, SchedulerOutput
from llmpipe.engine.sequence import Sequence
from llmpipe.errors import LLMPipeError
from llmpipe.layers.sampler import SamplingRow
from llmpipe.spec import Proposer


class Drafter:
    def __init__(self, proposer: Proposer, config: EngineConfig):
        self.proposer = proposer
        self.config = config  # its max_model_len as the core resolved it

    @classmethod
    def build(cls, config: EngineConfig, sampling_row: Callable[..., SamplingRow], progress: bool) -> Drafter | None:
        """The config's proposer (None: speculative decoding off)."""
        if config.speculative_method is None:
            return None
        if not config.kv_cache:
            raise LLMPipeError("speculative decoding verifies against the KV cache: it needs kv_cache=True")
        if config.speculative_method == "ngram":
            from llmpipe.spec.ngram import NgramProposer

            return cls(NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max), config)
        from llmpipe.spec.draft import DraftProposer  # loads a second model

        return cls(DraftProposer(config, config.model_config, sampling_row, progress), config)

    def draft(self, batch: SchedulerOutput, scheduler: Scheduler) -> None:
        if batch.decodes:
            limits = [min(self.config.num_speculative_tokens, self._room(seq) - 1) for seq in batch.decodes]
            proposals = self.proposer.propose(batch.decodes, limits)
            kept = scheduler.add_drafts(batch, {seq: p.token_ids for seq, p in proposals.items()})
            batch.proposals = {seq: proposals[seq] for seq in kept}
        self.proposer.prefill([item.seq for item in batch.prefills if item.completes_prefill])

    def _room(self, seq: Sequence) -> int:
        """Tokens seq may still gain: up to the context, and up to max_tokens."""
        left = self.config.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - len(seq.output_token_ids))
        return left

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)
