"""A BERT cross-encoder on a tiny random checkpoint (hidden 32, 2 layers, 4 heads, a WordPiece vocabulary
of our own, 24 tokens per pair): pair encodings, logits and scores against transformers'
BertForSequenceClassification and sentence-transformers' CrossEncoder."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from llmpipe.errors import InvalidRequestError, UnsupportedModelError
from llmpipe.pooling import is_encoder, load_encoder
from llmpipe.pooling.inputs import right_padded

WORDS = ["what", "is", "the", "capital", "of", "france", "paris", "city", "river", "seine", "flows", "through",
         "berlin", "germany", "a", "an", "and", "in", "on", "population", "large", "small", "museum", "art",
         "tower", "eiffel", "built", "year", "people", "live", "there", "how", "many", "?", ".", ","]
PIECES = ["##s", "##ing", "##ed", "##er"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_LENGTH = 24


def save_wordpiece_tokenizer(directory) -> None:
    """transformers' BertTokenizer on a small vocabulary: uncased WordPiece, [CLS] a [SEP] b [SEP], token types 0 then 1."""
    from transformers import BertTokenizer

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS + PIECES)}
    BertTokenizer(vocab=vocab, model_max_length=MAX_LENGTH).save_pretrained(directory)


def save_tiny_cross_encoder(directory, num_labels: int = 1) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=len(SPECIALS + WORDS + PIECES), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=num_labels)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    with torch.no_grad():  # weights large enough that the score depends on the pair (LayerNorm scales near 1)
        for name, parameter in model.named_parameters():
            parameter.normal_(1.0 if name.endswith("LayerNorm.weight") else 0.0, 0.1 if "LayerNorm" in name else 0.5)
    model.save_pretrained(directory)
    save_wordpiece_tokenizer(directory)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cross_encoder")
    save_tiny_cross_encoder(directory)
    return directory


def pairs(lengths: list[tuple[int, int]], seed: int = 0) -> list[tuple[str, str]]:
    """(query, document) of these many words; some words take a suffix piece, some pairs pass MAX_LENGTH."""
    rng = random.Random(seed)

    def text(length: int) -> str:
        return " ".join(rng.choice(WORDS) + rng.choice(["", "", "s", "ing"]) for _ in range(length))

    return [(text(q), text(d)) for q, d in lengths]


PAIRS = pairs([(3, 5), (1, 1), (6, 30), (20, 3), (15, 15), (4, 12), (2, 8)])


def test_pair_encodings_match_transformers(cross_encoder_dir):
    from transformers import AutoTokenizer

    encoder = load_encoder(cross_encoder_dir)
    reference = AutoTokenizer.from_pretrained(cross_encoder_dir)(
        [q for q, _ in PAIRS], [d for _, d in PAIRS], truncation=True, max_length=MAX_LENGTH)
    encoded = [encoder.encode_pair(q, d) for q, d in PAIRS]
    assert [ids for ids, _ in encoded] == reference["input_ids"]
    assert [types for _, types in encoded] == reference["token_type_ids"]
    assert encoder.max_len == MAX_LENGTH == max(len(ids) for ids, _ in encoded)


def test_logits_and_scores_match_transformers(cross_encoder_dir):
    from transformers import AutoTokenizer, BertForSequenceClassification

    encoder = load_encoder(cross_encoder_dir)
    reference = BertForSequenceClassification.from_pretrained(cross_encoder_dir).eval()
    features = AutoTokenizer.from_pretrained(cross_encoder_dir)(
        [q for q, _ in PAIRS], [d for _, d in PAIRS], truncation=True, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = reference(**features).logits[:, 0]

    encoded = [encoder.encode_pair(q, d) for q, d in PAIRS]
    input_ids, valid = right_padded([ids for ids, _ in encoded])
    token_type_ids, _ = right_padded([types for _, types in encoded])
    with torch.inference_mode():
        logits = encoder.model(input_ids, valid, token_type_ids)[:, 0]
    assert (logits - expected).abs().max() < 1e-5
    assert expected.std() > 0.1  # random enough that a wrong mask or pooler would show

    scores = encoder.score(encoded)
    assert scores.shape == (len(PAIRS),) and scores.dtype == torch.float32
    assert (scores - torch.sigmoid(expected)).abs().max() < 1e-5


def test_scores_match_sentence_transformers_cross_encoder(cross_encoder_dir):
    from sentence_transformers import CrossEncoder

    expected = torch.from_numpy(CrossEncoder(str(cross_encoder_dir), device="cpu").predict(PAIRS, batch_size=len(PAIRS)))
    encoder = load_encoder(cross_encoder_dir)
    assert (encoder.score([encoder.encode_pair(q, d) for q, d in PAIRS]) - expected).abs().max() < 1e-5


def test_what_it_declares_and_refuses(cross_encoder_dir, tmp_path):
    encoder = load_encoder(cross_encoder_dir)
    assert is_encoder(cross_encoder_dir)
    assert (encoder.task, encoder.dimensions, encoder.normalize, encoder.matryoshka) == ("score", 1, False, None)
    with pytest.raises(InvalidRequestError):
        encoder.embed([[2, 5, 3]])
    with pytest.raises(InvalidRequestError):
        encoder.score([([2, 5, 3, 6, 3], [0, 0, 0, 2, 1])])  # token type 2 of a 2-type vocabulary
    assert encoder.score([]).shape == (0,)

    two_labels = tmp_path / "two_labels"
    save_tiny_cross_encoder(two_labels, num_labels=2)
    with pytest.raises(UnsupportedModelError, match="2 labels"):
        load_encoder(two_labels)


def test_the_activation_sentence_transformers_saved(cross_encoder_dir, tmp_path):
    """sentence-transformers 6 writes the CrossEncoder's activation into config_sentence_transformers.json."""
    identity = shutil.copytree(cross_encoder_dir, tmp_path / "identity")
    (identity / "config_sentence_transformers.json").write_text(json.dumps({"activation_fn": "torch.nn.modules.linear.Identity"}))
    encoded = [load_encoder(cross_encoder_dir).encode_pair(q, d) for q, d in PAIRS]
    assert torch.allclose(torch.sigmoid(load_encoder(identity).score(encoded)), load_encoder(cross_encoder_dir).score(encoded))
