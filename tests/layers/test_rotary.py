"""YaRN RoPE tables against transformers' Llama rotary embedding (cos and sin scaled by the attention factor)."""

import pytest
import torch
import transformers

from llmpipe.layers.rotary import RotaryEmbedding

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("extra", [
    {},  # attention factor 0.1 ln(factor) + 1
    {"attention_factor": 1.0},
    {"mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},  # DeepSeek's mscale ratio
    {"truncate": False},
])
def test_yarn_tables_match_transformers_llama(extra):
    params = {**YARN, **extra, "rope_theta": 50000.0}
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=256, rope_parameters=params
    )
    positions = torch.arange(256)
    cos, sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)(
        torch.zeros(1, dtype=torch.float32), positions[None]
    )
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    ours = RotaryEmbedding(32, 256, 50000.0, scaling)
    our_cos, our_sin = ours.tables(positions, torch.float32)
    torch.testing.assert_close(our_cos[:, 0], cos[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(our_sin[:, 0], sin[0], atol=2e-5, rtol=0)
