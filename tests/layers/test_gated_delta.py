"""Gated DeltaNet's pure functions against transformers' Qwen3.5 linear-attention layer and its reference kernels,
and against each other: chunked prefill vs the per-token recurrence, chunk continuation, batched decode steps."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5GatedDeltaNet,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from llmpipe.layers.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    decay_and_beta,
    expand_heads,
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_step,
    gated_rms_norm,
    normalize_qk,
)

ATOL = 1e-5


@pytest.fixture(scope="module")
def hf_layer() -> Qwen3_5GatedDeltaNet:
    config = Qwen3_5TextConfig(
        hidden_size=64,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # two value heads per key head
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
    )
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).float().eval()
    with torch.no_grad():
        layer.dt_bias.normal_(0.0, 0.5)
        layer.norm.weight.normal_(1.0, 0.3)
        layer.conv1d.weight.normal_(0.0, 0.4)
    return layer


def dims(m: Qwen3_5GatedDeltaNet) -> tuple[int, int, int, int]:
    return m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim


def qkv_heads(m: Qwen3_5GatedDeltaNet, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's output [..., conv_dim] → normalized, expanded q, k and v [..., v_heads, dim]."""
    hk, hv, dk, dv = dims(m)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = (expand_heads(t.unflatten(-1, (hk, dk)), hv) for t in (q, k))
    q, k = normalize_qk(q, k)
    return q, k, v.unflatten(-1, (hv, dv))


def gates(m: Qwen3_5GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return decay_and_beta(F.linear(x, m.in_proj_a.weight), F.linear(x, m.in_proj_b.weight), m.A_log, m.dt_bias)


def output(m: Qwen3_5GatedDeltaNet, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    z = F.linear(x, m.in_proj_z.weight).unflatten(-1, (m.num_v_heads, m.head_v_dim))
    return F.linear(gated_rms_norm(out, z, m.norm.weight, m.layer_norm_epsilon).flatten(-2), m.out_proj.weight)


def layer_prefill(m, x, conv_state, state):
    """One sequence's chunk x [tokens, hidden] through the whole layer → (y, conv_state, state)."""
    qkv, conv_state = causal_conv1d(F.linear(x, m.in_proj_qkv.weight), m.conv1d.weight[:, 0], m.conv1d.bias, conv_state)
    q, k, v = qkv_heads(m, qkv)
    g, beta = gates(m, x)
    out, state = gated_delta_chunked(q, k, v, g, beta, state, chunk=8)  # a small chunk: several chunks in 37 tokens
    return output(m, x, out), conv_state, state


def layer_decode(m, x, conv_state, state):
    """One token for each of a batch x [batch, hidden]; conv_state and state are updated in place."""
    qkv = causal_conv1d_step(F.linear(x, m.in_proj_qkv.weight), m.conv1d.weight[:, 0], m.conv1d.bias, conv_state)
    q, k, v = qkv_heads(m, qkv)
    g, beta = gates(m, x)
    return output(m, x, gated_delta_step(q, k, v, g, beta, state))


def fresh_states(m, batch: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    _, hv, dk, dv = dims(m)
    conv_state = torch.zeros(*batch, m.conv_dim, m.conv_kernel_size - 1)
    return conv_state, torch.zeros(*batch, hv, dk, dv)


def prompt(seed: int, tokens: int = 37) -> torch.Tensor:
    return torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_layer_matches_transformers_on_a_full_prompt(hf_layer):
    x = prompt(1)
    expected = hf_layer(x.unsqueeze(0))[0]
    y, _, _ = layer_prefill(hf_layer, x, *fresh_states(hf_layer))
    assert expected.abs().mean() > 0.05  # a meaningful comparison, not two near-zero tensors
    torch.testing.assert_close(y, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_chunks_continue_where_the_previous_one_left_off(hf_layer):
    x = prompt(2)
    whole, whole_conv, whole_state = layer_prefill(hf_layer, x, *fresh_states(hf_layer))
    conv_state, state = fresh_states(hf_layer)
    parts = []
    for piece in x.split([5, 16, 1, 15]):  # the 1-token chunk is shorter than kernel - 1
        y, conv_state, state = layer_prefill(hf_layer, piece, conv_state, state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(conv_state, whole_conv, atol=0, rtol=0)
    torch.testing.assert_close(state, whole_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("prefilled", [0, 5])
@torch.no_grad()
def test_decode_steps_match_the_full_prompt_token_by_token(hf_layer, prefilled):
    x = prompt(3)
    whole, _, whole_state = layer_prefill(hf_layer, x, *fresh_states(hf_layer))
    conv_state, state = fresh_states(hf_layer)
    if prefilled:
        _, conv_state, state = layer_prefill(hf_layer, x[:prefilled], conv_state, state)
    conv_state, state = conv_state.unsqueeze(0).contiguous(), state.unsqueeze(0).contiguous()
    for t in range(prefilled, x.shape[0]):
        y = layer_decode(hf_layer, x[t : t + 1], conv_state, state)
        torch.testing.assert_close(y[0], whole[t], atol=ATOL, rtol=0)
    torch.testing.assert_close(state[0], whole_state, atol=ATOL, rtol=0)


@torch.no_grad()
def test_a_batch_of_decode_steps_equals_each_sequence_alone(hf_layer):
    prompts = [prompt(10 + i, tokens) for i, tokens in enumerate([3, 11, 7])]
    singles = [fresh_states(hf_layer, (1,)) for _ in prompts]
    conv_state, state = fresh_states(hf_layer, (3,))
    for i, p in enumerate(prompts):  # different histories, so different states
        _, conv_state[i], state[i] = layer_prefill(hf_layer, p, *fresh_states(hf_layer))
        singles[i][0][0], singles[i][1][0] = conv_state[i], state[i]
    for step in range(3):
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(100 + step))
        batched = layer_decode(hf_layer, x, conv_state, state)
        for i, (single_conv, single_state) in enumerate(singles):
            alone = layer_decode(hf_layer, x[i : i + 1], single_conv, single_state)
            torch.testing.assert_close(batched[i], alone[0], atol=1e-6, rtol=0)
            torch.testing.assert_close(state[i], single_state[0], atol=1e-6, rtol=0)
            # not bit-equal: the conv state holds the projection's output, and a 3-row matmul rounds like no 1-row one
            torch.testing.assert_close(conv_state[i], single_conv[0], atol=1e-6, rtol=0)


def random_inputs(tokens: int, heads: int = 3, dk: int = 16, dv: int = 24, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = normalize_qk(torch.randn(tokens, heads, dk, generator=gen), torch.randn(tokens, heads, dk, generator=gen))
    v = torch.randn(tokens, heads, dv, generator=gen)
    g = -torch.rand(tokens, heads, generator=gen) * torch.tensor([0.02, 0.3, 3.0])  # slow to fast forgetting
    beta = torch.rand(tokens, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 130])
def test_chunked_equals_recurrent_from_a_nonzero_state(tokens):
    q, k, v, g, beta, state = random_inputs(tokens, seed=tokens)
    before = state.clone()
    ref_out, ref_state = gated_delta_recurrent(q, k, v, g, beta, state)
    out, new_state = gated_delta_chunked(q, k, v, g, beta, state)
    assert torch.equal(state, before)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(new_state, ref_state, atol=ATOL, rtol=0)


def test_step_equals_recurrent():
    q, k, v, g, beta, state = random_inputs(6, seed=7)
    ref_out, ref_state = gated_delta_recurrent(q, k, v, g, beta, state)
    state = state.unsqueeze(0).clone()
    for t in range(6):
        out = gated_delta_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state)
        torch.testing.assert_close(out[0], ref_out[t], atol=ATOL, rtol=0)
    torch.testing.assert_close(state[0], ref_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("hf_rule", [torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule])
def test_matches_transformers_reference_rules(hf_rule):
    """Raw (unnormalized) q and k with 2 key heads for 4 value heads; transformers normalizes and scales inside."""
    gen = torch.Generator().manual_seed(5)
    tokens, hk, hv, dk, dv = 70, 2, 4, 16, 24
    raw_q, raw_k = torch.randn(tokens, hk, dk, generator=gen) * 3, torch.randn(tokens, hk, dk, generator=gen) * 3
    v = torch.randn(tokens, hv, dv, generator=gen)
    g, beta = decay_and_beta(torch.randn(tokens, hv, generator=gen), torch.randn(tokens, hv, generator=gen),
                             torch.randn(hv, generator=gen), torch.randn(hv, generator=gen))
    state = torch.randn(hv, dk, dv, generator=gen)

    expected, expected_state = hf_rule(
        raw_q[None], raw_k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    q, k = normalize_qk(expand_heads(raw_q, hv), expand_heads(raw_k, hv))
    for ours in (gated_delta_recurrent, gated_delta_chunked):
        out, new_state = ours(q, k, v, g, beta, state)
        torch.testing.assert_close(out, expected[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(new_state, expected_state[0], atol=ATOL, rtol=0)


def test_conv_continues_across_chunks_shorter_than_its_window():
    gen = torch.Generator().manual_seed(9)
    x, weight, bias = torch.randn(12, 10, generator=gen), torch.randn(10, 4, generator=gen), torch.randn(10, generator=gen)
    start = torch.randn(10, 3, generator=gen)
    whole, whole_state = causal_conv1d(x, weight, bias, start)
    state, parts = start, []
    for piece in x.split([1, 2, 1, 5, 3]):
        y, state = causal_conv1d(piece, weight, bias, state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=0)
    assert torch.equal(state, whole_state) and torch.equal(whole_state, x[-3:].t())
    step_state, steps = start.unsqueeze(0).clone(), []
    for t in range(12):
        steps.append(causal_conv1d_step(x[t : t + 1], weight, bias, step_state)[0])
    torch.testing.assert_close(torch.stack(steps), whole, atol=ATOL, rtol=0)
    assert torch.equal(step_state[0], whole_state)


@torch.no_grad()
def test_layer_follows_transformers_casts_in_bfloat16(hf_layer):
    """The same casts as transformers (beta in bfloat16, the kernel's output cast back before the norm): agreement to
    bfloat16 rounding, where float32 transformers differs from its bfloat16 self by much more."""
    layer = copy.deepcopy(hf_layer).to(torch.bfloat16)
    x = prompt(4).bfloat16()
    expected = layer(x.unsqueeze(0))[0]
    conv_state, state = fresh_states(layer)
    y, _, _ = layer_prefill(layer, x, conv_state.bfloat16(), state)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("dk, dv", [(16, 24), (128, 128)])
def test_the_c_decode_step_updates_the_pools_states_in_place_as_the_pytorch_step(dk, dv):
    """kernels/csrc/gated_delta.c on states where they sit in a pool, rows in any slot order: each row's output and
    its slot's new state as gated_delta_step's on a gathered copy; slots no row names keep their bits."""
    from llmpipe.kernels import ops

    torch.manual_seed(0)
    batch, heads, pool = 3, 4, 6
    q, k = normalize_qk(torch.randn(batch, heads, dk), torch.randn(batch, heads, dk))
    v, g, beta = torch.randn(batch, heads, dv), -torch.rand(batch, heads), torch.rand(batch, heads)
    state = torch.randn(pool, heads, dk, dv)
    slots = torch.tensor([4, 0, 2])
    expected_state = state[slots].clone()
    expected = gated_delta_step(q, k, v, g, beta, expected_state)
    before = state.clone()
    out = ops.gated_delta_step(q, k, v, g, beta, state, slots)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(state[slots], expected_state, atol=ATOL, rtol=0)
    untouched = torch.tensor([1, 3, 5])
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("conv_bias", [False, True])
@pytest.mark.parametrize("dk, dv, k_heads, v_heads, kernel", [(16, 24, 2, 4, 4), (128, 128, 2, 6, 3), (8, 8, 3, 3, 2)])
def test_the_c_decode_mixer_equals_the_pytorch_functions(tiled, conv_bias, dk, dv, k_heads, v_heads, kernel):
    """ops.gated_delta_decode (conv step, gates, normalized heads, delta step and gated norm in one C call) on a pool's
    states against the functions it fuses, composed as the layer composes them; slots no row names keep their bits."""
    from llmpipe.kernels import ops

    torch.manual_seed(1)
    batch, pool, eps = 3, 5, 1e-6
    key, value = k_heads * dk, v_heads * dv
    channels = 2 * key + value
    proj = torch.randn(batch, channels + value + 2 * v_heads) * 2
    weight, bias = torch.randn(channels, kernel) * 0.5, torch.randn(channels) if conv_bias else None
    A_log, dt_bias, norm_weight = torch.randn(v_heads) * 0.5, torch.randn(v_heads), torch.randn(dv) * 0.3 + 1
    conv, ssm = torch.randn(pool, channels, kernel - 1), torch.randn(pool, v_heads, dk, dv) * 0.1
    slots = torch.tensor([3, 0, 4])

    qkv, z, b, a = proj.split([channels, value, v_heads, v_heads], dim=-1)
    expected_conv, expected_ssm = conv[slots].clone(), ssm[slots].clone()
    mixed = causal_conv1d_step(qkv, weight, bias, expected_conv)
    q, k, v = mixed.split([key, key, value], dim=-1)
    q, k = (expand_heads(t.unflatten(-1, (k_heads, dk)), v_heads, tiled) for t in (q, k))
    g, beta = decay_and_beta(a, b, A_log, dt_bias)
    out = gated_delta_step(*normalize_qk(q, k), v.unflatten(-1, (v_heads, dv)), g, beta, expected_ssm)
    expected = gated_rms_norm(out, z.unflatten(-1, (v_heads, dv)), norm_weight, eps).flatten(-2)

    before_conv, before_ssm = conv.clone(), ssm.clone()
    got = ops.gated_delta_decode(proj, weight, bias, A_log, dt_bias, norm_weight, conv, ssm, slots, k_heads, eps, tiled)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(conv[slots], expected_conv, atol=0, rtol=0)
    torch.testing.assert_close(ssm[slots], expected_ssm, atol=ATOL, rtol=0)
    untouched = torch.tensor([1, 2])
    assert torch.equal(conv[untouched], before_conv[untouched]) and torch.equal(ssm[untouched], before_ssm[untouched])
