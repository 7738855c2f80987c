"""A decoder reranker's prompt for one (query, document) pair: Qwen3-Reranker's format.

The model is asked whether the document meets the query's requirements and answers "yes" or "no";
its P("yes") at the answer's position is the relevance score (engine/pooler.py). The format is the
model card's, which llama.cpp and vLLM also build: a fixed system turn, the instruction, query and
document in the user turn, and an empty thinking block opening the assistant's answer.
"""

from __future__ import annotations

from functools import cached_property

from llmpipe.errors import InvalidRequestError
from llmpipe.pooling.inputs import Truncator
from llmpipe.tokenizer import Tokenizer

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')


def rerank_prompt(query: str, document: str, instruction: str | None = None) -> str:
    user = f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")



class ScorePrompts:
    """(query, document) → the prompt a model scores: a decoder reranker's text in the format above, or a
    cross-encoder's pair encoding ([CLS] query [SEP] document [SEP], the longer text cut first to fit)."""

    def __init__(self, task: str, cross_encoder: bool, tokenizer: Tokenizer | None, max_len: int, model: str):
        self.task, self.cross_encoder, self.tokenizer, self.max_len, self.model = task, cross_encoder, tokenizer, max_len, model

    @cached_property
    def _pairs(self) -> Truncator:
        return Truncator(self.tokenizer, self.max_len)

    def prompt(self, query: str, document: str, instruction: str | None = None) -> dict:
        if self.task != "score":
            raise InvalidRequestError(f"{self.model} is not a reranker: scores are served by rerankers and cross-encoders "
                                      "(start a decoder reranker with --task score)", param="model")
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer to encode the query and documents", param="model")
        if self.cross_encoder:
            return {"prompt_token_ids": self._pairs.encode_pair(query, document)[0]}
        text = rerank_prompt(query, document, instruction)
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
