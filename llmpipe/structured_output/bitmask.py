"""Token bitmasks (llguidance's layout: int32 words, bit j of word w allows token 32 w + j) as the
logits mask the sampler applies."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def allowed_tokens(bitmasks: Sequence[np.ndarray], vocab_size: int, device: torch.device) -> torch.Tensor:
    """bool [rows, vocab_size]: True where a row's bitmask allows the token."""
    words = np.ascontiguousarray(np.stack(bitmasks), dtype=np.int32)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_)).to(device)


def any_token_left(bitmask: np.ndarray, banned: Sequence[int] = ()) -> bool:
    """Whether the bitmask allows a token that is not banned."""
    if banned:
        bitmask = bitmask.copy()
        ids = np.asarray(banned, dtype=np.int64)
        ids = ids[ids < 32 * len(bitmask)]
        np.bitwise_and.at(bitmask, ids // 32, ~(np.int32(1) << (ids % 32).astype(np.int32)))
    return bool(bitmask.any())
