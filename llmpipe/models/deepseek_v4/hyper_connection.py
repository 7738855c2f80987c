"""Manifold-constrained hyper-connections (mHC, DeepSeek V4): the residual is hc_mult parallel streams.

Before a block, one projection of the RMS-normalized streams gives three sets of weights: `pre` collapses
the streams into the block's input, `post` spreads the block's output back over the streams, and `comb`
(made doubly stochastic by Sinkhorn iterations) mixes the old streams into the new ones:
    streams' = post ⊗ block(Σ pre·streams) + combᵀ · streams
The weights are computed in float32, with float32 parameters, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.layers.linear import linear
from llmpipe.layers.norm import unweighted_rms_norm


class HyperConnection(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v4, n = cfg.extra, cfg.extra.hc_mult
        self.hc_mult, self.sinkhorn_iters, self.hc_eps = n, v4.hc_sinkhorn_iters, v4.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        mixes = (2 + n) * n  # pre (n), post (n), comb (n × n)
        self.fn = nn.Parameter(torch.empty(mixes, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty(mixes))
        self.scale = nn.Parameter(torch.empty(3))
        self.splits = torch.get_num_threads()

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, hidden] → post [T, n], comb [T, n, n] (float32) and the collapsed block input [T, hidden]."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps)
        mixes = linear(flat, self.fn.float(), splits=self.splits)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, self._sinkhorn(comb), collapsed

    def _sinkhorn(self, comb: torch.Tensor) -> torch.Tensor:
        """Columns, then (rows, columns) × (iters − 1): the reference's order."""
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return comb

    @staticmethod
    def expand(out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The new streams from the block's output [T, hidden], in the streams' dtype: post ⊗ out + combᵀ · streams."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The last collapse of the streams into one hidden state (sigmoid weights, no Sinkhorn)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.extra.hc_mult
        self.hc_eps, self.norm_eps = cfg.extra.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, n, hidden] → [T, hidden]."""
        mixes = F.linear(unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
