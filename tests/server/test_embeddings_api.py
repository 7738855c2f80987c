"""/v1/embeddings, /v1/rerank and /v1/score on llmpipe serve: the `openai` client's embeddings.create,
LangChain's OpenAIEmbeddings and plain HTTP, against LLM.embed / LLM.score on the same weights (whose
parity with transformers tests/pooling checks)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch
from langchain_openai import OpenAIEmbeddings

from llmpipe import LLM, SamplingParams
from tests.pooling.test_decoder_pooling import RERANK_CORPUS
from tests.server.utils import TINY_MODEL, live_server
from tests.utils import TINY_CONFIGS, build_checkpoint, save_tiny_tokenizer

TEXTS = ["the quick brown fox", "how does inference work?", "dog"]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    """The reference, called directly; never served (a served LLM's core steps on the server's thread, which would
    also step, and take the outputs of, requests this thread added to it)."""
    return LLM(str(tiny_checkpoint("qwen3")), progress=False)


@pytest.fixture(scope="module")
def url(tiny_checkpoint):
    """A server over a second LLM of the same checkpoint."""
    with live_server(LLM(str(tiny_checkpoint("qwen3")), progress=False)) as base:
        yield base


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> LLM:
    out = tmp_path_factory.mktemp("tiny-qwen3-reranker")
    build_checkpoint(*TINY_CONFIGS["qwen3"], out)
    save_tiny_tokenizer(out, 320, RERANK_CORPUS)
    return LLM(str(out), progress=False)


def expected(llm: LLM, texts: list[str]) -> list[list[float]]:
    return [output.outputs.embedding for output in llm.embed(texts, use_tqdm=False)]


def assert_same(got: list[list[float]], want: list[list[float]]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-6, rtol=0)


def test_the_openai_client_embeds_in_base64_and_float(llm, url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    reply = client.embeddings.create(model=TINY_MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert_same([d.embedding for d in reply.data], expected(llm, TEXTS))
    tokens = sum(len(llm.get_tokenizer().encode(t)) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    floats = client.embeddings.create(model=TINY_MODEL, input="dog", encoding_format="float", dimensions=8)
    assert len(floats.data[0].embedding) == 8
    assert sum(x * x for x in floats.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    ids = llm.get_tokenizer().encode("dog")
    by_ids = client.embeddings.create(model=TINY_MODEL, input=[ids], encoding_format="float")
    assert_same([by_ids.data[0].embedding], expected(llm, ["dog"]))


def test_langchain_embeds_documents_and_queries(llm, url):
    # check_embedding_ctx_length=False: LangChain sends the texts, not tiktoken's ids (as for any non-OpenAI model)
    embeddings = OpenAIEmbeddings(base_url=f"{url}/v1", api_key="x", model=TINY_MODEL, check_embedding_ctx_length=False)
    assert_same(embeddings.embed_documents(TEXTS), expected(llm, TEXTS))
    assert_same([embeddings.embed_query("dog")], expected(llm, ["dog"]))


@pytest.mark.parametrize("body, message", [
    ({"input": ""}, "empty"),
    ({"input": []}, "empty"),
    ({"input": "dog", "dimensions": 65}, "at most the model's 64"),
    ({"input": "dog", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [[1, 2, 10**6]]}, "integers in [0, 320)"),
    ({"input": "dog", "model": "other"}, "does not exist"),
])
def test_bad_embedding_requests_get_a_400_or_404(url, body, message):
    reply = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
    assert reply.status_code in (400, 404) and message in reply.json()["error"]["message"]


def test_rerank_and_score_are_refused_by_a_model_that_does_not_rerank(url):
    reply = httpx.post(f"{url}/v1/rerank", json={"query": "q", "documents": ["a"]}, timeout=60)
    assert reply.status_code == 400 and "not a reranker" in reply.json()["error"]["message"]
    reply = httpx.post(f"{url}/v1/score", json={"text_1": "q", "text_2": ["a"]}, timeout=60)
    assert reply.status_code == 400


def test_rerank_orders_documents_by_the_rerankers_scores(reranker):
    query, documents = "how does inference work?", ["the quick brown fox", "inference", "the lazy dog", "how"]
    scores = [o.outputs.score for o in reranker.score(query, documents, use_tqdm=False)]
    best_first = sorted(range(len(documents)), key=lambda i: -scores[i])
    with live_server(reranker) as base:
        reply = httpx.post(f"{base}/v1/rerank", json={"query": query, "documents": documents, "top_n": 3}, timeout=60)
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert [r["index"] for r in results] == best_first[:3]
        assert [r["relevance_score"] for r in results] == pytest.approx([scores[i] for i in best_first[:3]], abs=1e-6)
        assert [r["document"]["text"] for r in results] == [documents[i] for i in best_first[:3]]
        bare = httpx.post(f"{base}/v2/rerank", json={"query": query, "documents": [{"text": d} for d in documents],
                                                     "return_documents": False}, timeout=60).json()["results"]
        assert len(bare) == 4 and "document" not in bare[0]
        scored = httpx.post(f"{base}/v1/score", json={"text_1": query, "text_2": documents}, timeout=60).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(scores, abs=1e-6)


def test_embeddings_beside_a_stream_leave_its_tokens_unchanged(llm, url):
    """16 embedding requests while a completion streams: the stream's tokens are those it gets alone."""
    body = {"model": TINY_MODEL, "prompt": "the quick", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    alone = llm.generate(["the quick"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].text
    replies: list[httpx.Response] = []

    def embed() -> None:
        replies.append(httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS * 4}, timeout=120))

    threads = [threading.Thread(target=embed) for _ in range(16)]
    for thread in threads:
        thread.start()
    streamed = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    for thread in threads:
        thread.join()
    assert streamed == alone
    assert [r.status_code for r in replies] == [200] * 16
    assert_same(replies[0].json()["data"][0]["embedding"], expected(llm, TEXTS[:1])[0])


def test_a_thousand_inputs_are_one_request_to_the_waiting_queue(llm, url):
    """LangChain sends 1,000 texts a request by default: the queue's cap (512) counts the body, not its inputs."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    texts = [f"{TEXTS[i % 3]} {i}" for i in range(1000)]
    reply = client.embeddings.create(model=TINY_MODEL, input=texts, encoding_format="float")
    assert [d.index for d in reply.data] == list(range(1000))
    assert_same([reply.data[i].embedding for i in (0, 999)], expected(llm, [texts[0], texts[999]]))
