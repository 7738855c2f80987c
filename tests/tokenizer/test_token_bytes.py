"""Tokenizer.token_bytes: each token's own bytes (OpenAI's logprobs `bytes`), even for a token that
holds part of a UTF-8 sequence. Reference: the tokenizer's own decode of the whole sequence, whose
UTF-8 the tokens' bytes must rebuild exactly, one token at a time."""

from llmpipe.loader.gguf_file import open_gguf
from llmpipe.tokenizer import Tokenizer, load_gguf_tokenizer

TEXT = "héllo 世界 🙂 Ünïcödé, 𝔘𝔫𝔦 ⅝ ok\n\tdone"


def assert_rebuilds(tokenizer: Tokenizer, text: str) -> list[bytes]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == tokenizer.decode(ids).encode("utf-8")
    return pieces


def partial(pieces: list[bytes]) -> bool:
    """Some token is not whole UTF-8 on its own (the case decoding one token alone gets wrong)."""
    def whole(piece: bytes) -> bool:
        try:
            piece.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False
    return not all(map(whole, pieces))


def test_byte_level_tokens(smollm2_tokenizer):
    assert smollm2_tokenizer._vocabulary_kind == "byte_level"
    assert partial(assert_rebuilds(smollm2_tokenizer, TEXT))


def test_sentencepiece_byte_fallback_tokens(gemma3_gguf):
    # the engine's reader: gguf-py's parses the 262k-token vocabulary for ~10 s
    tokenizer = load_gguf_tokenizer(open_gguf(gemma3_gguf))
    assert tokenizer._vocabulary_kind == "sentencepiece"
    pieces = assert_rebuilds(tokenizer, TEXT)
    assert partial(pieces), "the text should reach SentencePiece's byte fallback"


def test_hf_tokenizer_and_special_tokens(tiny_tokenizer):
    assert_rebuilds(tiny_tokenizer, TEXT)
    eos = tiny_tokenizer.token_to_id("</s>")
    assert tiny_tokenizer.token_bytes(eos) == b"</s>"


def test_an_id_past_the_vocabulary_has_no_bytes(tiny_tokenizer):
    assert tiny_tokenizer.token_bytes(10**9) == b""
