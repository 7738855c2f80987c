"""An encoder's inputs: its tokenizer, truncation as sentence-transformers does it, the checks a
request's token id lists get, and right-padding a batch into tensors with a mask of real tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers
import torch

from llmpipe.errors import InvalidRequestError
from llmpipe.files import read_json
from llmpipe.tokenizer import Tokenizer, load_hf_tokenizer


def load_tokenizer(directory: Path) -> Tokenizer:
    """llmpipe's tokenizer of the directory, without the padding and truncation some tokenizer.json files
    carry from their export (all-MiniLM-L6-v2's pads and cuts every text to 128 tokens): transformers drops
    them too, and the encoders pad their batches themselves."""
    tokenizer = load_hf_tokenizer(directory)
    tokenizer.backend.no_padding()
    tokenizer.backend.no_truncation()
    return tokenizer


def max_input_length(directory: Path, configured: int | None, max_positions: int) -> int:
    """sentence-transformers' max_seq_length where configured, else the tokenizer config's
    model_max_length, within the model's position limit either way."""
    file = directory / "tokenizer_config.json"
    limit = configured or (read_json(file).get("model_max_length") if file.is_file() else None)
    return min(int(limit), max_positions) if limit else max_positions


class Truncator:
    """Encodes as a Hugging Face tokenizer called with truncation=True, max_length=max_len does: the special
    tokens kept, the text cut on the right, a pair's longer text cut first (longest_first)."""

    def __init__(self, tokenizer: Tokenizer, max_len: int):
        self._backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
        self._backend.enable_truncation(max_len)

    # The batch calls release the GIL (see Tokenizer.encode).
    def encode(self, text: str) -> list[int]:
        return self._backend.encode_batch([text])[0].ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """ids and token_type_ids (0 on the first text and its special tokens, 1 on the second's)."""
        encoding = self._backend.encode_batch([(first, second)])[0]
        return encoding.ids, encoding.type_ids


def check_ids(ids: Sequence[int], vocab_size: int, max_len: int) -> None:
    if not ids:
        raise InvalidRequestError("an input has no tokens")
    if len(ids) > max_len:
        raise InvalidRequestError(f"an input has {len(ids)} tokens, more than this model's {max_len}",
                                  code="context_length_exceeded")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequestError(f"token ids must lie in [0, {vocab_size}) for this model")


def right_padded(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] (0 past each row's end) and valid [B, T] (True on the rows' own tokens)."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    lengths = torch.tensor([len(row) for row in rows])
    return ids, torch.arange(width)[None, :] < lengths[:, None]
