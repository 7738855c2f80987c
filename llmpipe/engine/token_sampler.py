"""TokenSampler: a computed batch's logits turned into tokens — a ModelOutput, plain data the
scheduler applies.

Each sequence that samples this step (a decode, a prefill that completes, and the other samples of
an n > 1 request that start from that prefill) draws one token, or, with speculative drafts, the
drafts the target accepts and one more. Sample 0 of a request asking prompt logprobs gets those of
the positions its chunk computed. A sequence whose grammar, sampling or verification fails is named
in the output with why: one request's fault never sinks the batch. Nothing here changes a
sequence; `Scheduler.update_from_output` appends, stops and frees.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import torch

from llmpipe.engine.core_messages import RawLogprob, SpecDecodeStats
from llmpipe.engine.input_batch import InputBatch
from llmpipe.engine.model_output import ModelOutput, SampledTokens
from llmpipe.engine.scheduler import SchedulerOutput
from llmpipe.engine.sequence import Sequence
from llmpipe.layers.sampler import DeadEndError, SamplingRow, adjusted_logits, ranked_logprobs, sample, topn_logprobs
from llmpipe.spec import Proposal, verify
from llmpipe.structured_output import StructuredOutputManager
from llmpipe.structured_output.bitmask import any_token_left

logger = logging.getLogger(__name__)
PROMPT_LOGPROB_SLICE = 256  # prompt rows turned into logprobs at a time


class TokenSampler:
    def __init__(self, structured: StructuredOutputManager, eos_token_ids: set[int]):
        self.structured = structured
        self.eos_token_ids = eos_token_ids
        self.spec_stats = SpecDecodeStats()
        self.input_batch = InputBatch()  # the sequences' sampling parameters, as tensors kept per slot

    def release(self, seq: Sequence) -> None:
        """A finished or aborted sequence's slot is free again (a scheduler release hook)."""
        self.input_batch.release(seq)

    def sample(self, batch: SchedulerOutput, logits: torch.Tensor) -> ModelOutput:
        """logits as Runner.execute returns them: per sampled sequence its rows (its newest token and any
        drafts), then the chunks' prompt-logprob rows."""
        out = ModelOutput()
        sampled = batch.decodes + [item.seq for item in batch.prefills if item.completes_prefill and item.seq.pooling is None]
        widths = [1 + len(batch.draft_token_ids.get(seq, ())) for seq in sampled]
        starts = [0, *itertools.accumulate(widths)]
        self._prompt_logprobs(batch, logits[starts[-1] :], out)
        forked = [(row, sibling) for row, seq in enumerate(sampled) for sibling in batch.forks.get(seq, ())]  # same rows
        kept = [(row, seq) for row, seq in [*enumerate(sampled), *forked]
                if seq.request_id not in out.failed_requests and not seq.finished]
        spans, seqs = [(starts[row], widths[row]) for row, _ in kept], [seq for _, seq in kept]
        for seq in seqs if self.structured.active else ():
            error = self.structured.prepare(seq)
            if error is not None:
                out.failed[seq] = error
        plain = [i for i, seq in enumerate(seqs) if seq not in batch.proposals and seq not in out.failed]
        drawn = self._sample_each_or_alone(logits, [spans[i][0] for i in plain], [seqs[i] for i in plain], out)
        for i, tokens in drawn.items():
            out.sampled[seqs[plain[i]]] = tokens
        for (start, width), seq in zip(spans, seqs):
            if seq in batch.proposals and seq not in out.failed:
                self._verify(seq, logits[start : start + width], batch.proposals[seq], out)
        out.sampled = {seq: out.sampled[seq] for seq in seqs if seq in out.sampled}  # the sequences' order
        return out

    def _prompt_logprobs(self, batch: SchedulerOutput, logits: torch.Tensor, out: ModelOutput) -> None:
        """logits: the chunks' prompt-logprob rows, each chunk's after the previous one's."""
        first = 0
        for item in batch.prefills:
            seq = item.seq
            span = seq.prompt_logprob_positions(seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens)
            rows, first = logits[first : first + len(span)], first + len(span)
            if not span:
                continue
            try:
                targets = seq.prompt_token_ids[span.start + 1 : span.stop + 1]
                found: list[RawLogprob] = []
                for at in range(0, len(span), PROMPT_LOGPROB_SLICE):  # bounds the float32 copies' memory
                    part = rows[at : at + PROMPT_LOGPROB_SLICE].float().log_softmax(dim=-1)
                    found += ranked_logprobs(part, targets[at : at + PROMPT_LOGPROB_SLICE], seq.params.prompt_logprobs)
                out.prompt_logprobs[seq] = found
            except Exception:  # one sequence's fault must not sink the batch
                logger.exception("request %s failed computing its prompt logprobs; the others go on", seq.request_id)
                out.failed_requests[seq.request_id] = "the engine failed computing this request's prompt logprobs"

    def _sample_each_or_alone(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
                              out: ModelOutput) -> dict[int, SampledTokens]:
        """{i: seqs[i]'s token} sampled from logits[rows[i]] in one batch. If the batch raises, each row
        is sampled alone so that only the sequences at fault fail."""
        if not seqs:
            return {}
        bitmasks = self.structured.fill_bitmasks(seqs)  # the whole batch's at once
        sampling_rows = [self.sampling_row(seq, bitmask=bitmask) for seq, bitmask in zip(seqs, bitmasks)]
        # Every row in order (each step that samples every sequence's last position): no copy of the
        # logits (an indexed copy of Gemma 3's 262,144 took ~140 us a step).
        picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
        try:
            sampled = any(not row.params.greedy for row in sampling_rows)  # an all-greedy step reads none of them
            result = sample(picked, sampling_rows, self.input_batch.sampling_tensors(seqs) if sampled else None)
            return {i: SampledTokens([token], [lp]) for i, (token, lp) in enumerate(zip(result.token_ids, result.logprobs))}
        except DeadEndError:
            pass  # the rows at fault fail below, alone
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling each sequence alone", len(seqs))
        drawn = {}
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            try:
                result = sample(logits[[row]], [sampling_rows[i]])
                drawn[i] = SampledTokens(result.token_ids, result.logprobs)
            except DeadEndError as err:
                out.failed[seq] = str(err)
            except Exception:
                logger.exception("request %s failed sampling; the others go on", seq.request_id)
                out.failed[seq] = "the engine failed sampling this request's next token"
        return drawn

    def _verify(self, seq: Sequence, logits: torch.Tensor, proposal: Proposal, out: ModelOutput) -> None:
        """Rejection-sample the drafts against the target's rows: the accepted ones plus one more token."""
        try:
            drafts = proposal.token_ids
            bitmasks = self.structured.fill_bitmasks_through_drafts(seq, drafts)
            rows = [self.sampling_row(seq, drafts[:i], bitmasks[i]) for i in range(len(drafts) + 1)]
            tokens = verify(adjusted_logits(logits, rows), rows, proposal)
            out.sampled[seq] = SampledTokens(tokens, topn_logprobs(logits[: len(tokens)], tokens, rows[: len(tokens)]))
        except DeadEndError as err:
            out.failed[seq] = str(err)
            return
        except Exception:
            logger.exception("request %s failed verifying its drafts; the others go on", seq.request_id)
            out.failed[seq] = "the engine failed verifying this request's speculative tokens"
            return
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += len(tokens) - 1

    def sampling_row(self, seq: Sequence, drafts: list[int] = (), bitmask: np.ndarray | None = None) -> SamplingRow:
        """The sampling rules for seq's next token, after `drafts` if it is a speculative position;
        `bitmask`: the tokens its grammar allows there."""
        output = seq.output_token_ids + list(drafts) if drafts else seq.output_token_ids
        banned: list[int] = []
        if len(output) < seq.params.min_tokens:
            banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(self.eos_token_ids))
            if bitmask is not None and not any_token_left(bitmask, banned):
                banned = []  # the grammar can only end here: its end outranks min_tokens (GRAMMAR_END)
        return SamplingRow(seq.params, seq.generator, seq.prompt_token_ids, output, banned, bitmask)
