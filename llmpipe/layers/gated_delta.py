"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) as pure functions over explicit per-sequence state.

Each value head keeps a state S [k_dim, v_dim] (float32). Per token, with q and k l2-normalized and q scaled by k_dim^-0.5:

    S = exp(g) S                        decay (g <= 0 is the log decay)
    S = S + k (beta (v - S^T k))^T      delta rule: move S's prediction for k toward v, at rate beta in (0, 1)
    o = S^T q

The inputs q, k, v come out of a depthwise causal conv1d (kernel 4, SiLU) over the concatenated qkv projection, whose
state is the previous kernel - 1 inputs. The output is norm(o) * silu(z), per value head, before out_proj.

Shapes, one sequence: x [tokens, channels], q/k [tokens, heads, k_dim], v [tokens, heads, v_dim], g/beta [tokens, heads],
conv_state [channels, kernel - 1], state [heads, k_dim, v_dim]. The decode step takes a batch instead of tokens.
q and k must already have one head per value head (`expand_heads`) and be normalized and scaled (`normalize_qk`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # fixed in transformers and FLA (not the config's rms_norm_eps)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(depthwise causal conv) of one sequence's chunk x [tokens, channels], continuing after conv_state.

    weight [channels, kernel]; conv_state [channels, kernel - 1] holds the inputs before x (zeros for a new sequence).
    Returns (y [tokens, channels], the new conv_state: the last kernel - 1 inputs, reaching into the old state).
    """
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [channels, kernel - 1 + tokens]
    y = F.conv1d(window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]
    new_state = window[:, window.shape[1] - conv_state.shape[1] :].clone()
    return F.silu(y).t().to(x.dtype), new_state


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor
) -> torch.Tensor:
    """One decode token for a batch: x [batch, channels], conv_state [batch, channels, kernel - 1] updated in place."""
    window = torch.cat([conv_state, x.unsqueeze(-1).to(conv_state.dtype)], dim=-1)  # [batch, channels, kernel]
    conv_state.copy_(window[..., 1:])
    y = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        y = y + bias
    return F.silu(y).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (eps inside the root, as FLA's kernels have it)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def normalize_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 l2-normalized q and k, with the attention scale k_dim^-0.5 folded into q (transformers does both in
    float32, inside its kernels, after repeating heads; normalization is per head, so the order does not matter)."""
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def expand_heads(x: torch.Tensor, num_v_heads: int, tiled: bool = False) -> torch.Tensor:
    """[..., num_k_heads, dim] → [..., num_v_heads, dim]: key head i serves value heads i*r ... i*r + r - 1 (grouped,
    Hugging Face's order), or value heads i, i + K, i + 2K, ... (tiled: the order llama.cpp's converter puts them in)."""
    repeats = num_v_heads // x.shape[-2]
    if tiled:
        return x.repeat(*([1] * (x.dim() - 2)), repeats, 1)
    return x.repeat_interleave(repeats, dim=-2)


def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) softplus(a + dt_bias) in float32 (exp(A_log) can overflow half precision); beta = sigmoid(b),
    left in b's dtype as transformers leaves it (the kernels widen it to float32 afterwards)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate) over the last dim (v_dim): the norm in float32, cast to x's dtype before the
    weight (like Llama's RMSNorm), the gate in float32, one cast at the end. No 1 + weight offset here."""
    wide = x.float()
    normed = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


def gated_delta_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token recurrence (the reference). Returns (out [tokens, heads, v_dim] in v's dtype, the new state);
    `state` itself is not modified."""
    q, k, vf, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state.float().clone()
    out = torch.empty_like(vf)
    for t in range(q.shape[0]):
        s *= g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", s, k[t])
        delta = beta[t, :, None] * (vf[t] - predicted)
        s += k[t, :, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out.to(v.dtype), s


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence in chunkwise-parallel (WY) form, for prefill: same arguments and result as gated_delta_recurrent.

    Within a chunk starting from state S0, with G_t the cumulative log decay from the chunk's start through token t,
    the state after token t is  S_t = exp(G_t) S0 + sum_{i<=t} exp(G_t - G_i) k_i u_i^T,  where the pseudo-values
    u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} exp(G_i - G_j) (k_i.k_j) u_j)
    form the unit lower triangular system  (I + A) U = beta (V - exp(G) K S0),  A_ij = beta_i exp(G_i - G_j) k_i.k_j.
    Its solution is linear in S0, so it is solved once for every chunk (U = W_v - W_k S0) before the scan over chunks.
    """
    tokens, heads, k_dim = k.shape
    v_dim = v.shape[-1]
    chunk = max(1, min(chunk, tokens))
    # Zero padding is exact: a padded token has beta = 0 (writes nothing) and g = 0 (does not decay the state).
    pad = -tokens % chunk
    q, k, vf = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.float(), (0, 0, 0, pad)) for t in (g, beta))
    n = (tokens + pad) // chunk

    # [chunks, heads, chunk, ...]
    q, k, vf = (t.view(n, chunk, heads, -1).transpose(1, 2) for t in (q, k, vf))
    g, beta = (t.view(n, chunk, heads).transpose(1, 2) for t in (g, beta))

    G = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(G_i - G_j) <= 1 for j <= i; the masked exponents above the diagonal are positive and could overflow
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = A + torch.eye(chunk, device=q.device)
    rhs = beta[..., None] * torch.cat([vf, G.exp()[..., None] * k], dim=-1)
    W_v, W_k = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([v_dim, k_dim], dim=-1)

    attn = (q @ k.transpose(-1, -2)) * decay  # within the chunk, the diagonal included
    q_from_start = q * G.exp()[..., None]  # reads S0 decayed to each token
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]  # each token's write, decayed to the chunk's end
    chunk_decay = G[..., -1].exp()[..., None, None]

    s = state.float()
    out = torch.empty_like(vf)
    for c in range(n):
        u = W_v[c] - W_k[c] @ s
        out[c] = q_from_start[c] @ s + attn[c] @ u
        s = chunk_decay[c] * s + k_to_end[c].transpose(-1, -2) @ u
    out = out.transpose(1, 2).reshape(n * chunk, heads, v_dim)[:tokens]
    return out.to(v.dtype), s


def gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One decode token for a batch of sequences: q/k [batch, heads, k_dim], v [batch, heads, v_dim], g/beta
    [batch, heads]; state [batch, heads, k_dim, v_dim] float32, updated in place. Returns out [batch, heads, v_dim].

    The state is read by one matmul (S^T k and S^T q together); the output comes from the old state's reads, as
    o = S'^T q = exp(g) S^T q + (q.k) delta, so the update never has to be read back.
    """
    q, k, vf, g, beta = (t.float() for t in (q, k, v, g, beta))
    decay = g.exp()[..., None]
    reads = torch.stack([k, q], dim=-2) @ state  # [batch, heads, 2, v_dim]
    delta = beta[..., None] * (vf - decay * reads[..., 0, :])
    out = decay * reads[..., 1, :] + (q * k).sum(-1, keepdim=True) * delta
    state.mul_(decay[..., None]).addcmul_(k[..., :, None], delta[..., None, :])
    return out.to(v.dtype)
