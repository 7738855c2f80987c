"""IncrementalDetokenizer against the reference: a full decode of the same ids (and str.find for stops)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_helpers import UNICODE

from llmpipe.tokenizer import IncrementalDetokenizer, Tokenizer

# The tiny vocabulary was trained on English only: every non-ASCII character is split into byte tokens.
MULTIBYTE = UNICODE + ["🎉🎉 a🎉b", "ééé ü", "中文\n中文", "x" + "👍🏽" * 3]


def stream(tokenizer: Tokenizer, ids: list[int], **options) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, **options)
    deltas = [detok.add(token_id) for token_id in ids]
    if detok.stop_reason is None:
        deltas.append(detok.finish())
    return deltas, detok


def expected_stop(tokenizer: Tokenizer, ids: list[int], stops: list[str], skip: bool) -> tuple[str, str | None]:
    """Reference: decode each prefix of whole characters; the first to contain a stop string ends the
    output right before its earliest-starting stop (the first listed on a tie)."""
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end], skip_special_tokens=skip)
        if text.endswith("\ufffd") and end < len(ids):
            continue
        found = [(text.find(stop), order, stop) for order, stop in enumerate(stops) if stop and stop in text]
        if found:
            start, _, stop = min(found)
            return text[:start], stop
    return tokenizer.decode(ids, skip_special_tokens=skip), None


@pytest.mark.parametrize("text", MULTIBYTE)
def test_deltas_never_split_a_character(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode("utf-8")) // 2  # really split into byte-sized tokens
    full = tiny_tokenizer.decode(ids)
    deltas, _ = stream(tiny_tokenizer, ids)
    emitted = ""
    for delta in deltas:
        delta.encode("utf-8")  # raises on a lone surrogate
        assert "\ufffd" not in delta
        emitted += delta
        assert full.startswith(emitted)
    assert emitted == full == text


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_gguf_deltas_join_to_full_decode_on_varied_texts(smollm2_tokenizer, texts, skip_special_tokens):
    for text in texts[:300]:
        ids = smollm2_tokenizer.encode(text)
        deltas, detok = stream(smollm2_tokenizer, ids, skip_special_tokens=skip_special_tokens)
        full = smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detok.text == full
        assert all("\ufffd" not in delta for delta in deltas) or "\ufffd" in full


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 319), max_size=40), skip=st.booleans())
def test_deltas_join_to_full_decode_for_any_ids(tiny_tokenizer, ids, skip):
    """Arbitrary ids include broken UTF-8 and special tokens; the stream must still agree with decode."""
    deltas, detok = stream(tiny_tokenizer, ids, skip_special_tokens=skip)
    full = tiny_tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.text == full
    for index in range(len(deltas)):
        assert full.startswith("".join(deltas[: index + 1]))


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE (the `tokenizers` library's Metaspace pipeline): its decoder drops the
    space of whichever token comes first, so a window decoded without context would lose spaces."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<s>"], show_progress=False)
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return Tokenizer(backend, bos_token_id=0, eos_token_id=None, special_tokens={}, chat_template=None)


def test_deltas_keep_spaces_with_a_decoder_that_strips_the_first_one(metaspace_tokenizer):
    ids = metaspace_tokenizer.encode(" the lazy  dog jumps over the fox")
    deltas, _ = stream(metaspace_tokenizer, ids)
    assert len(deltas) > 5
    assert "".join(deltas) == metaspace_tokenizer.decode(ids) == "the lazy  dog jumps over the fox"


def test_stop_string_spanning_tokens_is_never_emitted(tiny_tokenizer):
    ids = tiny_tokenizer.encode("the quick brown fox jumps", add_special_tokens=False)
    deltas, detok = stream(tiny_tokenizer, ids, stop=["brown fox"])
    assert detok.stop_reason == "brown fox"
    assert "".join(deltas) == detok.text == "the quick "
    assert all("b" not in delta for delta in deltas)


def test_stop_string_included_when_asked(tiny_tokenizer):
    ids = tiny_tokenizer.encode("the quick brown fox jumps", add_special_tokens=False)
    _, detok = stream(tiny_tokenizer, ids, stop=["ick", "brown fox"], include_stop_str_in_output=True)
    assert (detok.text, detok.stop_reason) == ("the quick", "ick")


def test_held_back_prefix_of_a_stop_string_is_released_when_it_diverges(tiny_tokenizer):
    detok = IncrementalDetokenizer(tiny_tokenizer, stop=["fox!"])
    for token_id in tiny_tokenizer.encode("the fox jumps", add_special_tokens=False):
        detok.add(token_id)
        assert not detok.text.endswith(("f", "fo", "fox"))
    assert detok.finish() == "" and detok.text == "the fox jumps" and detok.stop_reason is None


def test_stop_string_made_of_special_token_text_matches_when_not_skipped(tiny_tokenizer):
    ids = tiny_tokenizer.encode("hi<|im_end|>there", add_special_tokens=False)
    _, shown = stream(tiny_tokenizer, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    _, skipped = stream(tiny_tokenizer, ids, skip_special_tokens=True, stop=["<|im_end|>"])
    assert (shown.text, shown.stop_reason) == ("hi", "<|im_end|>")
    assert (skipped.text, skipped.stop_reason) == ("hithere", None)


def test_finish_returns_unfinished_bytes_like_full_decode(tiny_tokenizer):
    ids = tiny_tokenizer.encode("ok 🎉", add_special_tokens=False)[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(tiny_tokenizer)
    assert "".join(detok.add(i) for i in ids) == "ok "
    assert detok.finish() == "\ufffd" == tiny_tokenizer.decode(ids)[len("ok "):]


def test_decode_window_stays_small_over_long_generation(tiny_tokenizer, monkeypatch):
    """Per-token cost is O(token length): each step decodes only a few ids, however long the output."""
    sizes: list[int] = []
    decode = tiny_tokenizer.decode

    def spy(ids, skip_special_tokens=True):
        sizes.append(len(ids))
        return decode(ids, skip_special_tokens)

    ids = tiny_tokenizer.encode("the lazy dog 🐶 über " * 300, add_special_tokens=False)
    monkeypatch.setattr(tiny_tokenizer, "decode", spy)
    _, detok = stream(tiny_tokenizer, ids, stop=["never appears"])
    assert detok.text == decode(ids)
    assert max(sizes) <= 8


STOP_ALPHABET = st.sampled_from(["the ", "fox", "o", "é", "🎉", "dog", " ", "<|im_end|>", "qu", "x"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(STOP_ALPHABET, max_size=15),
    stops=st.lists(st.text(st.sampled_from("theofxqué🎉 dg<|>_imn"), min_size=1, max_size=6), max_size=3),
    include=st.booleans(),
    skip=st.booleans(),
)
def test_stop_strings_truncate_like_search_over_decoded_prefixes(tiny_tokenizer, pieces, stops, include, skip):
    ids = tiny_tokenizer.encode("".join(pieces), add_special_tokens=False)
    truncated, stop = expected_stop(tiny_tokenizer, ids, stops, skip)
    deltas, detok = stream(tiny_tokenizer, ids, stop=stops, include_stop_str_in_output=include,
                           skip_special_tokens=skip)
    assert detok.stop_reason == stop
    assert "".join(deltas) == detok.text == truncated + (stop if include and stop else "")
