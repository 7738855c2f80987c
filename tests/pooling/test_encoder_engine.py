"""Encoders through the engine: all-minilm-l6-v2 (real weights) and a tiny BERT cross-encoder served by
LLM.embed / LLM.score and by `llmpipe serve`'s core process, against sentence-transformers, with the
`openai` client and LangChain's OpenAIEmbeddings."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from langchain_openai import OpenAIEmbeddings

from llmpipe import LLM, SamplingParams
from llmpipe.errors import InvalidRequestError
from llmpipe.loader.aliases import resolve_model
from llmpipe.pooling_params import PoolingParams
from tests.pooling.test_cross_encoder import pairs, save_tiny_cross_encoder
from tests.server.utils import core_process_engine, live_server

MINILM = "all-minilm-l6-v2"
TEXTS = ["How does inference work?", "Prefill is compute-bound; decode is bound by memory bandwidth.", "a",
         "The KV cache keeps the keys and values of every token already computed, so decode reads them back. " * 3]


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(resolve_model(MINILM)), device="cpu")


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM(MINILM, progress=False)


def assert_same_embeddings(got, want) -> None:
    got, want = (torch.stack([torch.as_tensor(row, dtype=torch.float32) for row in rows]) for rows in (got, want))
    assert got.shape == want.shape
    assert torch.nn.functional.cosine_similarity(got, want).min() > 1 - 1e-5
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_llm_embed_equals_sentence_transformers(minilm, reference):
    assert minilm.engine.config.task == "embed" and minilm.engine.config.max_model_len == 256
    outputs = minilm.embed(TEXTS, use_tqdm=False)
    assert_same_embeddings([o.outputs.embedding for o in outputs], reference.encode(TEXTS, convert_to_tensor=True))
    cut = minilm.embed(TEXTS[:1], PoolingParams(dimensions=128), use_tqdm=False)[0].outputs.embedding
    full = reference.encode(TEXTS[:1], convert_to_tensor=True)[0]
    assert_same_embeddings([cut], [torch.nn.functional.normalize(full[:128], dim=0)])


def test_an_encoder_refuses_what_it_cannot_do(minilm):
    with pytest.raises(InvalidRequestError, match="does not generate"):
        minilm.generate(["hi"], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="not a reranker"):
        minilm.score("q", ["d"])
    with pytest.raises(InvalidRequestError, match="context"):
        minilm.embed([TEXTS[3] * 20], use_tqdm=False)  # over its 256 tokens: refused, not cut silently


def test_served_from_a_core_process_to_the_openai_client_and_langchain(reference):
    expected = reference.encode(TEXTS, convert_to_tensor=True)
    with live_server(core_process_engine(MINILM), "minilm") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
        reply = client.embeddings.create(model="minilm", input=TEXTS)
        assert_same_embeddings([d.embedding for d in reply.data], expected)
        embeddings = OpenAIEmbeddings(base_url=f"{url}/v1", api_key="x", model="minilm", check_embedding_ctx_length=False)
        assert_same_embeddings(embeddings.embed_documents(TEXTS), expected)
        assert_same_embeddings([embeddings.embed_query(TEXTS[0])], expected[:1])
        refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 400


def test_a_cross_encoder_scores_and_reranks_as_sentence_transformers(tmp_path):
    from sentence_transformers import CrossEncoder

    save_tiny_cross_encoder(tmp_path)
    llm = LLM(str(tmp_path), progress=False)
    assert llm.engine.config.task == "score"
    cases = pairs([(3, 5), (2, 9), (4, 30), (1, 1)])  # the third passes 24 tokens: cut longest first
    query = cases[0][0]
    documents = [document for _, document in cases]
    expected = CrossEncoder(str(tmp_path), device="cpu").predict([(query, d) for d in documents], convert_to_tensor=True)
    scores = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(scores), expected.float(), atol=1e-6, rtol=0)
    with live_server(llm) as url:
        reply = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": documents, "top_n": 2}, timeout=60)
        assert reply.status_code == 200, reply.text
        best = sorted(range(len(documents)), key=lambda i: -scores[i])[:2]
        assert [r["index"] for r in reply.json()["results"]] == best
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "a"}, timeout=60).status_code == 400
