"""The pooling routes' bodies and replies: OpenAI's `/v1/embeddings`, the Jina / Cohere `/v1/rerank`
that llama-server and vLLM serve, and vLLM's `/v1/score`.

Each input (or query-document pair) is one engine request with PoolingParams: the engine batches
them with each other and with generation, a prompt's chunks under the same token budget as any
prompt's (the streams beside them keep their pace: EngineConfig.max_decode_stall), and each ends
with its prompt, its KV blocks freed at once. A chat model embeds too (last-token pooling,
normalized), as llama-server's does; scores need a reranker or a cross-encoder, else a 400.
"""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np

from llmpipe.errors import InvalidRequestError
from llmpipe.outputs import RequestOutput
from llmpipe.pooling.prompts import SentencePrompts
from llmpipe.pooling.rerank_prompt import ScorePrompts
from llmpipe.pooling_params import PoolingParams
from llmpipe.server.input_processor import InputProcessor, parse_body, prompt_list
from llmpipe.server.pooling_protocol import MAX_INPUTS, EmbeddingRequest, RerankRequest, ScoreRequest

Prompts = list[dict]


def embedding_inputs(inputs: InputProcessor, prompts: SentencePrompts,
                     raw: bytes) -> tuple[EmbeddingRequest, Prompts, PoolingParams]:
    body = parse_body(EmbeddingRequest, raw)
    inputs.check_model(body.model)
    texts = prompt_list(body.input, MAX_INPUTS, "input")
    requests = [inputs.text_prompt(prompts.apply(text, body.prompt_name) if isinstance(text, str) else text,
                                   body.add_special_tokens, body.truncate_prompt_tokens, "input") for text in texts]
    return body, requests, PoolingParams("embed", body.dimensions, body.normalize)


def rerank_inputs(inputs: InputProcessor, prompts: ScorePrompts, raw: bytes) -> tuple[RerankRequest, Prompts]:
    body = parse_body(RerankRequest, raw)
    inputs.check_model(body.model)
    return body, [_truncated(inputs, prompts.prompt(body.query, text, body.instruction), body.truncate_prompt_tokens)
                  for text in document_texts(body)]


def score_inputs(inputs: InputProcessor, prompts: ScorePrompts, raw: bytes) -> tuple[ScoreRequest, Prompts]:
    body = parse_body(ScoreRequest, raw)
    inputs.check_model(body.model)
    queries = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    documents = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        raise InvalidRequestError(f"{len(queries)} text_1 entries for {len(documents)} text_2 entries: give one, or one "
                                  "per text_2 entry", param="text_1")
    return body, [_truncated(inputs, prompts.prompt(q, d, body.instruction), body.truncate_prompt_tokens)
                  for q, d in zip(queries, documents)]


def document_texts(body: RerankRequest) -> list[str]:
    return [doc if isinstance(doc, str) else doc.text for doc in body.documents]


def _truncated(inputs: InputProcessor, prompt: dict, keep: int | None) -> dict:
    if keep is None:
        return prompt
    return {"prompt_token_ids": inputs.truncate(prompt["prompt_token_ids"], keep)}


# ---- replies ------------------------------------------------------------------------------------

def embedding_reply(model: str, body: EmbeddingRequest, finals: list[RequestOutput]) -> dict:
    """OpenAI's list of embeddings; base64: each vector's little-endian float32 bytes, as OpenAI encodes them."""
    data = [{"object": "embedding", "index": i, "embedding": _encoded(final.pooled, body.encoding_format)}
            for i, final in enumerate(finals)]
    tokens = _prompt_tokens(finals)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def rerank_reply(model: str, body: RerankRequest, finals: list[RequestOutput]) -> dict:
    """The documents by relevance, best first (the top_n best, if asked), each with its index in the request."""
    texts = document_texts(body)
    order = sorted(range(len(finals)), key=lambda i: -finals[i].pooled[0])
    results = [{"index": i, "relevance_score": finals[i].pooled[0]} | ({"document": {"text": texts[i]}}
                                                                       if body.return_documents else {})
               for i in order[: body.top_n or None]]
    tokens = _prompt_tokens(finals)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results}


def score_reply(model: str, finals: list[RequestOutput]) -> dict:
    tokens = _prompt_tokens(finals)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": final.pooled[0]} for i, final in enumerate(finals)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _prompt_tokens(finals: list[RequestOutput]) -> int:
    return sum(len(final.prompt_token_ids) for final in finals)
