"""The gated MLP on a large step: its rows run in near-equal parts of at most MLP_CHUNK_ROWS (the step's largest
activations, gate_up's 2 × intermediate floats a row, held for a part at a time), each row's result its own; a
projection with forward hooks (LoRA's per-row deltas) sees the step's rows whole."""

import torch
import torch.nn.functional as F

from llmpipe.config import ModelConfig
from llmpipe.models.llama.model import MLP_CHUNK_ROWS, LlamaMLP


def mlp() -> LlamaMLP:
    torch.manual_seed(0)
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=4096)
    module = LlamaMLP(cfg)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return module.eval()


def reference(module: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    gate_up = x.double() @ module.gate_up_proj.weight.double().T
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up @ module.down_proj.weight.double().T


def test_a_large_step_runs_the_mlp_in_near_equal_parts_with_each_rows_own_result():
    module, x = mlp(), torch.randn(2 * MLP_CHUNK_ROWS + 76, 64)
    parts = []
    whole = module.gated

    def recording(part: torch.Tensor) -> torch.Tensor:
        parts.append(part.shape[0])
        return whole(part)

    module.gated = recording
    with torch.no_grad():
        y = module(x)
    assert parts == [367, 367, 366]
    torch.testing.assert_close(y.double(), reference(module, x), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(y, whole(x), atol=1e-6, rtol=1e-6)  # as the step's rows at once


def test_a_step_within_the_bound_and_a_hooked_projection_take_the_rows_whole():
    module = mlp()
    seen = []
    with torch.no_grad():
        module.gated = lambda part: seen.append(part.shape[0]) or torch.zeros(part.shape[0], 64)
        module(torch.randn(MLP_CHUNK_ROWS, 64))
        del module.gated
        rows = []
        module.gate_up_proj.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
        y = module(torch.randn(3 * MLP_CHUNK_ROWS, 64))
    assert seen == [MLP_CHUNK_ROWS] and rows == [3 * MLP_CHUNK_ROWS] and y.shape == (3 * MLP_CHUNK_ROWS, 64)
