"""StopRules: a sample's new tokens appended in order, each checked against the token-level rules
that end a sequence: a stop token id, EOS (unless ignore_eos, and not before min_tokens), a grammar
that has ended, max_tokens, the context. Stop strings need text, so the front end checks them and
aborts the sample that matched one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from llmpipe.config import EngineConfig
from llmpipe.engine.sequence import Sequence
from llmpipe.structured_output import StructuredOutputManager
from llmpipe.structured_output.manager import GRAMMAR_END, GrammarExhausted

if TYPE_CHECKING:
    from llmpipe.engine.model_output import SampledTokens

logger = logging.getLogger(__name__)


class StopRules:
    def __init__(self, config: EngineConfig, eos_token_ids: set[int], structured: StructuredOutputManager):
        self.config = config  # its max_model_len as the core resolved it
        self.eos_token_ids = eos_token_ids
        self.structured = structured

    def emit(self, seq: Sequence, sampled: SampledTokens) -> int:
        """Append the tokens in order until one ends the sequence; the number of tokens taken."""
        taken = 0
        for token, info in zip(sampled.token_ids, sampled.logprobs):
            if seq.finished:
                break
            try:
                if info is not None and seq.new_logprobs is not None:
                    logprob, rank, top = info
                    seq.new_logprobs.append((float(logprob), int(rank), [(int(t), float(lp)) for t, lp in top]))
                self.append(seq, token)
            except Exception:  # one sequence's fault must not sink the batch
                logger.exception("request %s failed; the others go on", seq.request_id)
                seq.fail("the engine failed handling this request's tokens")
            taken += 1
        return taken

    def append(self, seq: Sequence, token: int) -> None:
        """Record the token and apply the rules."""
        seq.append_token(token)
        try:
            self.structured.advance(seq, token)
        except GrammarExhausted as err:
            # The token was one the grammar allowed: its parser ran out of llguidance's limits. The
            # output so far is a valid prefix, cut short by a limit as max_tokens would cut it.
            logger.warning("request %s: %s; its output ends here", seq.request_id, err)
            seq.finish("length")
            return
        params = seq.params
        may_stop = len(seq.output_token_ids) >= params.min_tokens
        if may_stop and token in params.stop_token_ids:
            seq.finish("stop", token)
        elif may_stop and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish("stop")
        elif token in self.eos_token_ids and self.structured.is_complete(seq):
            # ignore_eos, or under min_tokens, but the grammar has ended: it allowed nothing but EOS
            seq.finish("stop", None if may_stop else GRAMMAR_END)
        elif params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            seq.finish("length")
        elif seq.num_tokens >= self.config.max_model_len:
            seq.finish("length")
