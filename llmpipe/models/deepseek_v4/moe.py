"""DeepSeek V4's mixture of experts: routed experts (clamped SwiGLU) plus one shared expert.

Each token goes to num_experts_per_tok experts, weighted by their scores (scoring_func of the router
logits) normalized over the chosen ones and times routed_scaling_factor. Top-k layers choose by score
plus a per-expert correction bias; hash layers ("hash_moe") take the experts a fixed token-id table
gives. The experts' weights are 3-D, [experts, out, in]; each expert that got tokens runs once on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmpipe.config import ModelConfig
from llmpipe.layers.linear import Linear, linear
from llmpipe.layers.moe import dispatch

SCORE_FUNCTIONS = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate) × up on [..., gate | up], the gate clamped above at `limit`, up to ±limit."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class Router(nn.Module):
    """Scores = scoring_func(router logits); a subclass chooses the experts, their scores weigh them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v4 = cfg.extra
        self.top_k, self.scaling = v4.num_experts_per_tok, v4.routed_scaling_factor
        self.score_fn = SCORE_FUNCTIONS[v4.scoring_func]
        self.weight = nn.Parameter(torch.empty(v4.num_experts, cfg.hidden_size))
        self.splits = torch.get_num_threads()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] → each token's expert weights and expert ids, [T, top_k] each."""
        scores = self.score_fn(linear(x, self.weight, splits=self.splits))
        indices = self.choose(scores, input_ids)
        weights = scores.gather(1, indices)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, indices

    def choose(self, scores: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TopKRouter(Router):
    """The top_k experts by score plus a per-expert correction bias (the bias steers the choice only)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.extra.num_experts), requires_grad=False)

    def choose(self, scores: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices


class HashRouter(Router):
    """The experts a fixed token id → expert ids table (`tid2eid`) gives."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.tid2eid = nn.Parameter(torch.empty(cfg.vocab_size, self.top_k, dtype=torch.long), requires_grad=False)

    def choose(self, scores: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tid2eid[input_ids]


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v4 = cfg.extra
        experts, hidden, inner = v4.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        self.limit = v4.swiglu_limit
        self.splits = torch.get_num_threads()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts of weight × expert(x): tokens grouped by expert, one pass per hit expert."""
        return dispatch(x, weights, indices, self.gate_up_proj.shape[0], self._expert)

    def _expert(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        h = clamped_swiglu(linear(x, self.gate_up_proj[expert], splits=self.splits), self.limit)
        return linear(h, self.down_proj[expert], splits=self.splits)


class SharedExpert(nn.Module):
    """The always-on expert: gate and up stacked into one matrix, the same clamped SwiGLU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inner = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inner, bias=False)
        self.gate_up_proj.shard_sizes = (inner, inner)
        self.down_proj = Linear(inner, cfg.hidden_size, bias=False)
        self.limit = cfg.extra.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.limit))


class DeepseekV4MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        is_hash = cfg.extra.mlp_layer_types[layer] == "hash_moe"
        self.gate = HashRouter(cfg) if is_hash else TopKRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden], input_ids: [T] (the hash layers route by them)."""
        weights, indices = self.gate(x, input_ids)
        return self.experts(x, weights, indices) + self.shared_experts(x)
