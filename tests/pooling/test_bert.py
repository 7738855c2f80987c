"""all-MiniLM-L6-v2 (the all-minilm-l6-v2 alias: BERT → mean pooling → Normalize, max_seq_length 256):
llmpipe's ids and embeddings against sentence-transformers', and what the loader refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmpipe.errors import InvalidRequestError, UnsupportedModelError
from llmpipe.loader.aliases import resolve_model
from llmpipe.pooling import is_encoder, load_encoder

TEXTS = [
    "A man is eating food.",
    "Embeddings map sentences to vectors; cosine similarity compares them.",
    "Ünïcödé, CJK 漢字 and an emoji 🙂 — tokenized as BERT's uncased WordPiece does.",
    "x",
    " ".join(f"token{i} and more words" for i in range(120)),  # ~600 tokens: cut to 256
]


@pytest.fixture(scope="module")
def minilm() -> Path:
    return resolve_model("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def encoder(minilm):
    return load_encoder(minilm)


@pytest.fixture(scope="module")
def reference(minilm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


def reference_ids(reference, texts: list[str]) -> list[list[int]]:
    """The ids sentence-transformers' encode feeds its model, padding removed."""
    features = reference.preprocess(texts)
    return [ids[mask.bool()].tolist() for ids, mask in zip(features["input_ids"], features["attention_mask"])]


def test_ids_and_embeddings_match_sentence_transformers(encoder, reference):
    ids = [encoder.encode(text) for text in TEXTS]
    assert ids == reference_ids(reference, TEXTS)
    assert len(encoder.tokenizer.encode(TEXTS[-1])) > max(map(len, ids)) == encoder.max_len == 256

    ours = encoder.embed(ids)
    expected = torch.from_numpy(reference.encode(TEXTS, batch_size=len(TEXTS)))
    assert ours.shape == (len(TEXTS), 384) and ours.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(ours, expected).min() > 1 - 1e-5
    assert (ours - expected).abs().max() < 1e-5


def test_padding_does_not_change_an_embedding(encoder):
    ids = [encoder.encode(text) for text in TEXTS]
    alone = torch.cat([encoder.embed([one]) for one in ids])
    assert (encoder.embed(ids) - alone).abs().max() < 1e-5


def test_what_the_encoder_declares(minilm, encoder):
    assert minilm.is_dir() and is_encoder(minilm)
    declared = encoder.task, encoder.max_len, encoder.dimensions, encoder.normalize, encoder.matryoshka
    assert declared == ("embed", 256, 384, True, None)
    assert encoder.tokenizer.encode("hello world") == [101, 7592, 2088, 102]  # no padding to 128 from tokenizer.json
    assert encoder.embed([]).shape == (0, 384)


def test_requests_it_refuses(encoder):
    with pytest.raises(InvalidRequestError, match="more than"):
        encoder.embed([[101] + [1000] * 300 + [102]])
    with pytest.raises(InvalidRequestError):
        encoder.embed([[101, 30522, 102]])
    with pytest.raises(InvalidRequestError):
        encoder.embed([[]])
    with pytest.raises(InvalidRequestError):
        encoder.encode_pair("query", "document")


def linked_copy(source: Path, target: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """The model directory with its files linked, except those left out (paths inside it, to be written anew)."""
    def link(src: str, dst: str) -> None:
        if Path(src).relative_to(source).as_posix() not in leave_out:
            Path(dst).symlink_to(src)

    shutil.copytree(source, target, copy_function=link)
    return target


def test_a_bert_prefixed_checkpoint_with_pretraining_heads(minilm, encoder, tmp_path):
    directory = linked_copy(minilm, tmp_path / "prefixed", leave_out=("model.safetensors",))
    tensors = {f"bert.{name}": tensor for name, tensor in load_file(minilm / "model.safetensors").items()}
    save_file(tensors | {"cls.predictions.bias": torch.zeros(30522)}, directory / "model.safetensors")
    ids = [encoder.encode(text) for text in TEXTS[:3]]
    assert torch.equal(load_encoder(directory).embed(ids), encoder.embed(ids))


def test_directories_it_refuses(minilm, tmp_path):
    pickled = linked_copy(minilm, tmp_path / "pickled", leave_out=("model.safetensors",))
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(UnsupportedModelError, match="pytorch_model.bin"):
        load_encoder(pickled)

    max_pooling = linked_copy(minilm, tmp_path / "max_pooling", leave_out=("1_Pooling/config.json",))
    (max_pooling / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 384, "pooling_mode": "max"}))
    with pytest.raises(UnsupportedModelError, match="pooling 'max'"):
        load_encoder(max_pooling)

    no_modules = linked_copy(minilm, tmp_path / "no_modules", leave_out=("modules.json",))
    with pytest.raises(UnsupportedModelError, match="modules.json"):
        load_encoder(no_modules)
