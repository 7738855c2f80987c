"""EmbeddingGemma's layout on a tiny random checkpoint: a bidirectional Gemma3TextModel (sliding and full
layers, a window short enough to matter) → mean pooling → Dense(32→128) → Dense(128→32) → Normalize,
saved by sentence-transformers itself; llmpipe's embeddings against SentenceTransformer.encode."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from llmpipe.errors import InvalidRequestError, UnsupportedModelError
from llmpipe.pooling import is_encoder, load_encoder

WORDS = [f"w{i}" for i in range(60)]
MAX_SEQ_LENGTH = 20
SLIDING_WINDOW = 6  # config.json's value: a sliding layer sees 3 positions either way


def save_word_tokenizer(directory) -> None:
    """One id per word, <bos> text <eos>, padded on the right (as EmbeddingGemma's tokenizer pads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3} | {word: i + 4 for i, word in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>", padding_side="right").save_pretrained(directory)


def tiny_gemma_body(directory) -> None:
    from transformers import Gemma3TextConfig, Gemma3TextModel

    config = Gemma3TextConfig(
        vocab_size=len(WORDS) + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        query_pre_attn_scalar=24, sliding_window=SLIDING_WINDOW, use_bidirectional_attention=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    )
    torch.manual_seed(0)
    model = Gemma3TextModel(config)
    with torch.no_grad():
        for parameter in model.parameters():  # the norms too: (1 + weight) should not be all ones
            parameter.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    save_word_tokenizer(directory)


@pytest.fixture(scope="module")
def embedding_gemma_dir(tmp_path_factory):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    root = tmp_path_factory.mktemp("embedding_gemma")
    tiny_gemma_body(root / "hf")
    torch.manual_seed(1)
    up = Dense(32, 128, bias=False, activation_function=torch.nn.Identity(), init_weight=torch.randn(128, 32) * 0.2)
    down = Dense(128, 32, bias=False, activation_function=torch.nn.Identity(), init_weight=torch.randn(32, 128) * 0.2)
    modules = [Transformer(str(root / "hf"), max_seq_length=MAX_SEQ_LENGTH), Pooling(32, "mean"), up, down, Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(root / "st"))
    return root / "st"


def texts(lengths: list[int], seed: int) -> list[str]:
    """Texts of these many words (past max_seq_length, they are cut)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=length)) for length in lengths]


@pytest.fixture(scope="module")
def reference(embedding_gemma_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_gemma_dir), device="cpu")


def test_embeddings_match_sentence_transformers(embedding_gemma_dir, reference):
    encoder = load_encoder(embedding_gemma_dir)
    batch = texts([1, 30, 7, 2, 18, 25, 4, 11, 3, 19, 40, 9], seed=0)
    ids = [encoder.encode(text) for text in batch]
    assert ids == reference.tokenizer(batch, truncation=True, max_length=MAX_SEQ_LENGTH)["input_ids"]
    
    ours = encoder.embed(ids)
    expected = torch.from_numpy(reference.encode(batch, batch_size=len(batch)))
    assert ours.shape == (12, 32) and ours.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(ours, expected)
    assert cosine.min() > 1 - 1e-5, cosine
    assert (ours - expected).abs().max() < 1e-5
    assert torch.allclose(ours.norm(dim=-1), torch.ones(12))


def test_padding_does_not_change_an_embedding(embedding_gemma_dir):
    encoder = load_encoder(embedding_gemma_dir)
    ids = [encoder.encode(text) for text in texts([2, 17, 5, 30, 9, 1], seed=1)]
    together = encoder.embed(ids)
    alone = torch.cat([encoder.embed([one]) for one in ids])
    assert (together - alone).abs().max() < 1e-6


def test_the_window_matters(embedding_gemma_dir):
    """A sliding layer that saw the whole text would give another embedding."""
    encoder = load_encoder(embedding_gemma_dir)
    ids = encoder.encode(texts([18], seed=2)[0])
    windowed = encoder.embed([ids])
    encoder.model.attention_masks = lambda valid: dict.fromkeys(("sliding_attention", "full_attention"), valid[:, None, None, :])
    assert (encoder.embed([ids]) - windowed).abs().max() > 1e-3


def test_metadata_and_refusals(embedding_gemma_dir, tmp_path):
    encoder = load_encoder(embedding_gemma_dir)
    assert (encoder.task, encoder.max_len, encoder.dimensions, encoder.normalize) == ("embed", MAX_SEQ_LENGTH, 32, True)
    assert is_encoder(embedding_gemma_dir)
    with pytest.raises(InvalidRequestError):
        encoder.embed([list(range(4, 4 + MAX_SEQ_LENGTH + 1))])
    with pytest.raises(InvalidRequestError):
        encoder.embed([[2, 1000, 1]])
    with pytest.raises(InvalidRequestError):
        encoder.score([([2, 5, 1], [0, 0, 0])])

    carded = shutil.copytree(embedding_gemma_dir, tmp_path / "carded")  # a card as sentence-transformers writes it
    (carded / "README.md").write_text('### Loss\n```json\n{\n    "loss": "MultipleNegativesRankingLoss",\n'
                                      '    "matryoshka_dims": [\n        32,\n        16,\n        8\n    ]\n}\n```\n')
    assert encoder.matryoshka is None and load_encoder(carded).matryoshka == (32, 16, 8)

    causal = shutil.copytree(embedding_gemma_dir, tmp_path / "causal")  # Gemma 3 the LM, in the same layout
    config = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps(config | {"use_bidirectional_attention": False}))
    assert not is_encoder(causal)
    with pytest.raises(UnsupportedModelError, match="not a bidirectional Gemma 3"):
        load_encoder(causal)
