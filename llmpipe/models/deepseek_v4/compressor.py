"""DeepSeek V4's KV compressors: `ratio` consecutive tokens pooled into one cache entry.

Each token projects a value C and a gate Z (per channel). Entry w pools the tokens of its window with
softmax(Z + position bias) over the window, channel by channel, then RMSNorm and RoPE at position w × ratio.
- HCA (heavily compressed): windows [w·r, (w+1)·r) do not overlap.
- CSA (compressed sparse): every token projects two halves (Ca | Cb); entry w pools the Ca half of window
  w − 1 with the Cb half of window w, 2r tokens with stride r. Its lightning indexer compresses the
  same windows into small keys that score which entries each query attends to.

The engine keeps each token's projections (`project`) in the cache's window rows until the windows
that need them have closed; `pool` turns closed windows into entries.
"""

from __future__ import annotations

import torch
from torch import nn

from llmpipe.layers.linear import Linear
from llmpipe.layers.norm import Float32RMSNorm
from llmpipe.layers.rotary import InterleavedRotaryEmbedding, apply_interleaved_rotary


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.width = 2 * dim if overlap else dim  # projected channels per token (Ca | Cb with overlap)
        self.kv_proj = Linear(hidden_size, self.width, bias=False)
        self.gate_proj = Linear(hidden_size, self.width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, self.width))
        self.kv_norm = Float32RMSNorm(dim, eps)

    @property
    def row_width(self) -> int:
        """Cache channels one token's projections take: value and gate."""
        return 2 * self.width

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] → each token's [value | gate], [T, row_width]."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def pool(
        self, rows: torch.Tensor, first_window: int, has_previous: bool, rope: InterleavedRotaryEmbedding
    ) -> torch.Tensor:
        """Entries of windows first_window, first_window + 1, … from their tokens' projections.

        rows: [windows, ratio, row_width], one window after another; with overlap and has_previous the
        first window is the one before first_window (only its Ca half is read). Returns [entries, dim]."""
        value, gate = rows[..., : self.width], rows[..., self.width :].float() + self.position_bias.float()
        if self.overlap:
            value, gate = self._overlap(value, gate, has_previous)
        weights = gate.softmax(dim=1).to(value.dtype)
        entries = self.kv_norm((value * weights).sum(dim=1))
        positions = torch.arange(entries.shape[0], device=rows.device) * self.ratio + first_window * self.ratio
        cos, sin = rope.tables(positions)
        return apply_interleaved_rotary(entries.unsqueeze(1), cos, sin).squeeze(1)

    def _overlap(self, value: torch.Tensor, gate: torch.Tensor, has_previous: bool):
        """Windows' Ca halves shifted one window on, beside their own Cb halves: [entries, 2·ratio, dim].
        Without a previous window the first entry's Ca slots weigh nothing (gate −inf)."""
        d = self.dim
        if has_previous:
            prev_value, prev_gate, value, gate = value[:-1, :, :d], gate[:-1, :, :d], value[1:], gate[1:]
        else:
            prev_value = torch.cat([torch.zeros_like(value[:1, :, :d]), value[:-1, :, :d]])
            prev_gate = torch.cat([torch.full_like(gate[:1, :, :d], float("-inf")), gate[:-1, :, :d]])
        return torch.cat([prev_value, value[..., d:]], dim=1), torch.cat([prev_gate, gate[..., d:]], dim=1)


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, heads: int):
        super().__init__()
        self.weights_proj = Linear(hidden_size, heads, bias=False)


class Indexer(Compressor):
    """CSA's lightning indexer: compressed keys of index_head_dim, scored by
    Σ_h w_h · ReLU(q_h · k) over index heads; each query keeps its top-k entries."""

    def __init__(self, hidden_size: int, q_lora_rank: int, heads: int, dim: int, ratio: int, top_k: int, eps: float):
        super().__init__(hidden_size, dim, ratio, overlap=True, eps=eps)
        self.heads, self.top_k = heads, top_k
        self.q_b_proj = Linear(q_lora_rank, heads * dim, bias=False)
        self.scorer = IndexerScorer(hidden_size, heads)

    def select(
        self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        keys: torch.Tensor, visible: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries each query attends to: the top-k by index score among those `visible` to it
        ([queries, entries] bool); keys [entries, dim] shared by the queries, or [queries, entries, dim].
        Returns their indices [queries, k] and which of them are visible
        (a query that sees fewer than k entries gets some it may not use)."""
        q = self.q_b_proj(q_residual).view(x.shape[0], self.heads, self.dim)
        q = apply_interleaved_rotary(q, cos, sin).float()
        scores = torch.relu(q @ keys.float().transpose(-1, -2)) * self.dim**-0.5  # [queries, heads, entries]
        weights = self.scorer.weights_proj(x).float() * self.heads**-0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.top_k, keys.shape[-2]), dim=-1).indices
        return top, visible.gather(1, top)
