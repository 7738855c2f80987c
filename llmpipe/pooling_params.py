"""PoolingParams: what a pooling request asks of the model instead of tokens (vLLM's PoolingParams).

"embed": the prompt's embedding — the model's pooled hidden state (a decoder's last token after the
final norm; an encoder's own pooling and projections), cut to `dimensions` (Matryoshka) and
L2-normalized unless `normalize` is False. "score": one relevance score in [0, 1] of a (query,
document) prompt — a cross-encoder's classifier, or a decoder reranker's P("yes") against "no".
"""

from __future__ import annotations

from dataclasses import dataclass

from llmpipe.errors import InvalidRequestError

POOLING_TASKS = ("embed", "score")


@dataclass
class PoolingParams:
    task: str = "embed"
    dimensions: int | None = None  # keep the first N dimensions (then normalize)
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}", param="task")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}", param="dimensions")
