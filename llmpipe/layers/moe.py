"""Mixture of experts: a router gives each token its top-k experts and their weights; each expert that
got tokens this step runs once, over all of them (a batched product in prefill, a row or a few in decode),
and its outputs, weighted, are summed back into their tokens' rows.

A token reads only its k experts' weights: a 30B-A3B model's decode streams ~3B parameters a token,
its memory holds all 30B.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from llmpipe.layers.linear import linear
from llmpipe.quant.linear import stacked_linear


def dispatch(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, num_experts: int,
             expert: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """Σ over each row's experts of weight × expert(row, e): x [T, hidden]; weights, indices [T, k]. Rows
    are grouped by expert, so each expert that got any runs once, on all of its rows."""
    if x.shape[0] == 1:  # one token (batch-1 decode): its k experts in turn, no grouping
        out = torch.zeros_like(x)
        for e, w in zip(indices[0].tolist(), weights[0].unbind()):
            out += expert(x, e) * w
        return out
    flat = indices.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows, scales = order // indices.shape[1], weights.flatten()[order].unsqueeze(1)
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count:
            hit = rows[start : start + count]
            out.index_add_(0, hit, (expert(x.index_select(0, hit), e) * scales[start : start + count]).to(out.dtype))
        start += count
    return out


class SoftmaxTopKRouter(nn.Module):
    """Softmax over the router's logits (float32), the top_k experts by probability, renormalized over
    them where `renormalize` (Qwen3-MoE's norm_topk_prob); the weights come back in the input's dtype.
    Renormalized, this is gpt-oss's softmax over the top_k logits (its router has a bias)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, bias: bool = False):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.splits = torch.get_num_threads()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] → each token's expert weights and expert ids, [T, top_k] each."""
        probs = linear(x, self.weight, self.bias, splits=self.splits).softmax(dim=-1, dtype=torch.float32)
        weights, indices = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), indices


class Experts(nn.ModuleList):
    """One gated MLP per expert (`gate_up_proj`, `glu`, `down_proj`: linears that quantize and load as any
    other's), run by `dispatch` over the rows routed to it. A single token (batch-1 decode) takes its k
    experts' gate_up in one product (GGUF blocks: one kernel call, the activation quantized once), their
    activations as one [k, inner] tensor, then each expert's down on its own row."""

    def __init__(self, experts: Iterable[nn.Module]):
        super().__init__(experts)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._one_token(x, weights, indices[0].tolist())
        return dispatch(x, weights, indices, len(self), lambda rows, e: self[e](rows))

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, ids: list[int]) -> torch.Tensor:
        experts = [self[e] for e in ids]
        inner = experts[0].down_proj.in_features
        gate, up = stacked_linear(x, [e.gate_up_proj for e in experts]).view(len(ids), 2, inner).unbind(1)
        h = experts[0].glu(gate, up)
        y = torch.cat([e.down_proj(h[j : j + 1]) for j, e in enumerate(experts)])  # [k, hidden]
        return weights.to(y.dtype) @ y
