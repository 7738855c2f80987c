"""A decoder's embeddings and a decoder reranker's scores, through the engine's scheduler (pooling
requests beside generation), against transformers on the same tiny random checkpoint."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from llmpipe import LLM, SamplingParams
from llmpipe.errors import InvalidRequestError
from llmpipe.pooling.rerank_prompt import rerank_prompt
from llmpipe.pooling_params import PoolingParams
from tests.server.utils import live_server
from tests.utils import build_checkpoint, save_tiny_tokenizer, TINY_CONFIGS

TEXTS = ["the quick brown fox", "how does inference work? the lazy dog jumps over the quick fox " * 3, "dog"]
RERANK_CORPUS = ["yes", "no", rerank_prompt("how does inference work?", "the quick brown fox jumps over the lazy dog")]


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def llm(qwen3):
    return LLM(str(qwen3), progress=False, max_num_batched_tokens=32)  # long inputs pool over several chunks


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory):
    """A Qwen3 whose tokenizer spells "yes" and "no" as one token each, as Qwen3-Reranker's does; "reranker"
    in its name, as the released checkpoints'."""
    out = tmp_path_factory.mktemp("tiny-qwen3-reranker")
    class_name, extra = TINY_CONFIGS["qwen3"]
    build_checkpoint(class_name, extra, out)
    save_tiny_tokenizer(out, 320, RERANK_CORPUS)
    return out


def reference_last_hidden(path, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0, -1]


def test_embeddings_are_the_last_tokens_normalized_hidden_state(llm, qwen3):
    tokenizer = llm.get_tokenizer()
    outputs = llm.embed(TEXTS, use_tqdm=False)
    assert len(tokenizer.encode(TEXTS[1])) > 32  # pooled across chunks
    for text, output in zip(TEXTS, outputs):
        reference = torch.nn.functional.normalize(reference_last_hidden(qwen3, tokenizer.encode(text)), dim=-1)
        embedding = torch.tensor(output.outputs.embedding)
        assert embedding.shape == reference.shape
        assert torch.dot(embedding, reference) > 1 - 1e-5
        torch.testing.assert_close(embedding, reference, atol=1e-5, rtol=0)


def test_dimensions_cut_then_normalize_and_normalize_false_keeps_the_hidden_state(llm, qwen3):
    ids = llm.get_tokenizer().encode(TEXTS[0])
    hidden = reference_last_hidden(qwen3, ids)
    cut = llm.embed([ids], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(cut), torch.nn.functional.normalize(hidden[:16], dim=-1), atol=1e-5, rtol=0)
    raw = llm.embed([ids], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(raw), hidden, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("stall", [None, 2.5], ids=["prefill-chunks", "decode-rows"])
def test_embeddings_beside_generation_change_neither(llm, qwen3, stall):
    """Pooling requests in the same steps as a decode: the generated tokens and the embeddings are each
    what they are alone, as prefill chunks or, under a stall cap, a few prompt tokens a step fed as decode
    rows (the step stays on the decode path)."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["the quick"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    embedded_alone = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    if stall is not None:
        llm = LLM(str(qwen3), progress=False, max_decode_stall=stall)
    engine, rows = llm.engine, []
    schedule = engine.core.scheduler.schedule

    def recorded(*budgets):
        out = schedule(*budgets)
        rows.append(sum(out.pooling_rows.values()))
        return out

    engine.core.scheduler.schedule = recorded
    engine.add_request("gen", "the quick", greedy)
    engine.step()
    for i, text in enumerate(TEXTS):
        engine.add_request(f"emb{i}", text, PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert (sum(rows) > 0) == (stall is not None)
    assert finished["gen"].outputs[0].token_ids == alone
    for i, expected in enumerate(embedded_alone):
        torch.testing.assert_close(torch.tensor(finished[f"emb{i}"].pooled), torch.tensor(expected), atol=1e-5, rtol=0)
    stats = engine.stats()  # nothing is held once the pooling requests end
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_bytes_in_use == 0


def test_a_prompt_as_long_as_the_context_embeds(qwen3):
    llm = LLM(str(qwen3), progress=False, max_model_len=40)
    ids = llm.get_tokenizer().encode(TEXTS[1])[:40]
    assert len(llm.embed([ids], use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(InvalidRequestError, match="context"):
        llm.embed([ids + ids[:1]], use_tqdm=False)


def test_scores_need_a_reranker(llm):
    with pytest.raises(InvalidRequestError, match="not a reranker"):
        llm.score("how does inference work?", ["the quick brown fox"])


def test_a_decoder_reranker_scores_p_yes_against_no(reranker_path):
    import transformers

    llm = LLM(str(reranker_path), progress=False)
    assert llm.engine.config.task == "score"  # from its name
    query, documents = "how does inference work?", ["the quick brown fox", "the lazy dog jumps over", "inference"]
    outputs = llm.score(query, documents, use_tqdm=False)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(reranker_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(reranker_path, dtype=torch.float32)
    yes, no = hf_tokenizer.convert_tokens_to_ids("yes"), hf_tokenizer.convert_tokens_to_ids("no")
    for document, output in zip(documents, outputs):
        ids = hf_tokenizer(rerank_prompt(query, document), add_special_tokens=False)["input_ids"]
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        expected = torch.softmax(logits[[no, yes]], dim=-1)[1].item()
        assert output.outputs.score == pytest.approx(expected, abs=1e-5)
    with pytest.raises(InvalidRequestError, match="queries"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)


@pytest.fixture(scope="module")
def sentence_decoder(qwen3, tmp_path_factory):
    """The tiny Qwen3 as a sentence-transformers model, saved as one is: the body alone (AutoModel's names, no
    LM head), mean pooling, a Dense projection with tanh, Normalize."""
    from sentence_transformers import SentenceTransformer, models

    out = tmp_path_factory.mktemp("tiny-qwen3-sentence")
    torch.manual_seed(1)
    body = models.Transformer(str(qwen3))
    body.tokenizer.pad_token = body.tokenizer.eos_token
    dense = models.Dense(64, 32, activation_function=torch.nn.Tanh())
    modules = [body, models.Pooling(64, pooling_mode="mean"), dense, models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    # As released models were saved (sentence-transformers < 6): text in, no chat-template "message" modality.
    config = json.loads((out / "sentence_bert_config.json").read_text())
    config.pop("modality_config", None)
    config.pop("module_output_name", None)
    (out / "sentence_bert_config.json").write_text(json.dumps(config))
    st_config = json.loads((out / "config_sentence_transformers.json").read_text())
    st_config["prompts"] = {"query": "how does inference work? ", "document": ""}  # as Qwen3-Embedding's
    (out / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return out


def test_a_sentence_transformers_decoder_pools_as_its_pipeline_says(sentence_decoder):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(sentence_decoder), device="cpu")
    llm = LLM(str(sentence_decoder), progress=False, max_num_batched_tokens=16)  # the long text's mean spans chunks
    assert llm.engine.config.task == "embed"
    outputs = llm.embed(TEXTS, use_tqdm=False)
    for text, output in zip(TEXTS, outputs):
        expected = reference.encode([text], convert_to_tensor=True)[0]
        embedding = torch.tensor(output.outputs.embedding)
        assert embedding.shape == (32,) and torch.dot(embedding, expected) > 1 - 1e-5
        torch.testing.assert_close(embedding, expected, atol=1e-5, rtol=0)
    again = llm.embed(TEXTS[1:2], use_tqdm=False)[0].outputs.embedding  # its blocks are cached now: mean reads them all
    torch.testing.assert_close(torch.tensor(again), torch.tensor(outputs[1].outputs.embedding), atol=1e-6, rtol=0)
    with pytest.raises(InvalidRequestError, match="does not generate"):
        llm.generate(["the quick"], SamplingParams(max_tokens=2))
    queried = llm.embed(TEXTS, use_tqdm=False, prompt_name="query")
    for text, output in zip(TEXTS, queried):
        expected = reference.encode([text], prompt_name="query", convert_to_tensor=True)[0]
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-5, rtol=0)
    with pytest.raises(InvalidRequestError, match="prompt_name 'passage'"):
        llm.embed(TEXTS, use_tqdm=False, prompt_name="passage")
    with live_server(llm) as url:
        reply = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[:1], "prompt_name": "query"}, timeout=60)
        torch.testing.assert_close(torch.tensor(reply.json()["data"][0]["embedding"]),
                                   torch.tensor(queried[0].outputs.embedding), atol=1e-6, rtol=0)
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "a", "prompt_name": "x"}, timeout=60).status_code == 400
