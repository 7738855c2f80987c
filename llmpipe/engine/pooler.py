"""Pooler: what the pooling requests' prompt chunks computed → each request's result once its prompt completes.

A decoder pools its prompt's final hidden states (after the final norm) as its sentence-transformers
pipeline says (modules.json: mean, cls or lasttoken pooling, then its Dense projections) or its GGUF's
pooling_type (llama.cpp's converter writes it for embedding models), and by the last token where neither
says (what Qwen3-Embedding, e5-mistral and gte-Qwen2 train, and vLLM's and
llama-server's default for decoders). "embed" keeps the first `dimensions` and L2-normalizes; "score"
reads a decoder reranker's verdict on its (query, document) prompt: P("yes") against "no" at the last
token, sigmoid(logit_yes - logit_no) (Qwen3-Reranker's scoring). Mean pooling sums the chunks as they
are computed (a prompt longer than a step's budget pools across steps). A request whose pooling fails
is named with why; the others keep their results.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from llmpipe.engine.scheduler import ScheduledChunk
from llmpipe.engine.sequence import Sequence
from llmpipe.errors import UnsupportedModelError
from llmpipe.pooling.pipeline import Dense, read_modules, read_pipeline

logger = logging.getLogger(__name__)
SUM, FIRST, LAST = range(3)  # the rows of RunnerOutput.pooled per chunk
Results = dict[Sequence, list[float]]


class Pooler:
    def __init__(self, model: nn.Module, score_token_ids: tuple[int, int] | None, method: str = "lasttoken",
                 dense: tuple[Dense, ...] = ()):
        self.model = model
        self.score_token_ids = score_token_ids  # (no, yes): the model reranks (task "score")
        self.method = method  # mean, cls or lasttoken
        self.dense = dense
        self.partial: dict[Sequence, torch.Tensor] = {}  # mean: the rows summed so far; cls: the first row

    @property
    def reads_every_token(self) -> bool:
        """Whether a prompt's every position must be computed (no prefix-cache hits): mean and cls pooling."""
        return self.method != "lasttoken"

    def release(self, seq: Sequence) -> None:
        self.partial.pop(seq, None)

    def pool(self, chunks: list[ScheduledChunk], computed: torch.Tensor) -> tuple[Results, dict[Sequence, str]]:
        """({seq: its result}, {seq: why it failed}) for the pooling chunks of a step whose prompts completed;
        `computed`: RunnerOutput.pooled, a row per chunk."""
        pooled, failed = {}, {}
        for item, rows in zip(chunks, computed):
            seq = item.seq
            try:
                vector = self._accumulate(item, rows)
                if item.completes_prefill:
                    pooled[seq] = self._score(rows[LAST]) if seq.pooling.task == "score" else self._embed(seq, vector)
            except Exception:
                logger.exception("request %s failed pooling; the others go on", seq.request_id)
                failed[seq] = "the engine failed pooling this request's hidden states"
        return pooled, failed

    def _accumulate(self, item: ScheduledChunk, rows: torch.Tensor) -> torch.Tensor | None:
        """The pooled vector once the prompt completes: mean sums every chunk, cls keeps the first one's
        first row (a chunk from position 0 starts afresh: a preempted sequence recomputes its prompt)."""
        seq = item.seq
        if self.method == "lasttoken":
            return rows[LAST]
        if seq.num_computed_tokens == 0:
            value = rows[FIRST] if self.method == "cls" else rows[SUM]
        else:
            value = self.partial[seq] if self.method == "cls" else self.partial[seq] + rows[SUM]
        if not item.completes_prefill:
            self.partial[seq] = value
            return None
        self.partial.pop(seq, None)
        return value / seq.num_tokens if self.method == "mean" else value

    def _embed(self, seq: Sequence, vector: torch.Tensor) -> list[float]:
        for dense in self.dense:
            vector = dense(vector)
        vector = vector[: seq.pooling.dimensions]
        if seq.pooling.normalize:
            vector = nn.functional.normalize(vector, dim=-1)
        return vector.tolist()

    @torch.inference_mode()
    def _score(self, row: torch.Tensor) -> list[float]:
        no, yes = self.score_token_ids
        logits = self.model.compute_logits(row[None].to(self.model.model.embed_tokens.weight.dtype)).float()[0]
        return [torch.sigmoid(logits[yes] - logits[no]).item()]

    @property
    def embedding_size(self) -> int:
        return self.dense[-1].weight.shape[0] if self.dense else self.model.config.hidden_size


def build_pooler(model: nn.Module, checkpoint, task: str) -> Pooler:
    """The checkpoint's pooling: its sentence-transformers pipeline where it has one, a GGUF's pooling_type,
    else the last token."""
    score = score_tokens(checkpoint) if task == "score" else None
    path = Path(checkpoint.path)
    if path.is_dir() and read_modules(path) is not None:
        pipeline = read_pipeline(path)
        return Pooler(model, score, pipeline.pooling, pipeline.dense)
    return Pooler(model, score, checkpoint.config.pooling or "lasttoken")


def score_tokens(checkpoint) -> tuple[int, int]:
    """(no, yes): the token ids a decoder reranker answers with (each must be one token)."""
    tokenizer = checkpoint.tokenizer
    ids = [tokenizer.encode(word, add_special_tokens=False) if tokenizer is not None else [] for word in ("no", "yes")]
    if any(len(word) != 1 for word in ids):
        raise UnsupportedModelError(f"{checkpoint.path.name}: task 'score' reads a decoder's 'yes' / 'no' logits, and "
                                    "its tokenizer does not spell each as one token")
    return ids[0][0], ids[1][0]


def resolve_task(task: str, name: str, embedding_only: bool) -> str:
    """A decoder's task: "embed" for a body without its head; "score" where asked, or where the checkpoint's
    name says it reranks (llama.cpp's converter also knows Qwen3-Reranker by its name: its config.json is a
    plain causal LM's)."""
    if embedding_only:
        if task not in ("auto", "embed"):
            raise UnsupportedModelError(f"{name}: a body without its LM head embeds only (task {task!r} needs the head)")
        return "embed"
    if task == "auto":
        return "score" if "reranker" in name.lower() else "generate"
    return task
