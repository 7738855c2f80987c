"""Every weight a Llama-family model loads, by Hugging Face name, with its expected shape."""

from __future__ import annotations

from llmpipe.config import DEEPSEEK_V4_FAMILY, GEMMA3_FAMILY, ModelConfig


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Llama family and Gemma 3 (DeepSeek V4: its model's own list). Ordered as the model uses them: embedding,
    layer 0 … N−1, final norm, LM head (unless tied)."""
    if config.architecture in DEEPSEEK_V4_FAMILY:
        from llmpipe.models.deepseek_v4.model import checkpoint_shapes  # the model, built on the meta device, lists them

        return checkpoint_shapes(config)
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                f"{layer}.self_attn.q_proj.bias": (q_dim,),
                f"{layer}.self_attn.k_proj.bias": (kv_dim,),
                f"{layer}.self_attn.v_proj.bias": (kv_dim,),
            }
        if config.architecture in GEMMA3_FAMILY:  # norms after attention and around the FFN
            shapes |= {
                f"{layer}.pre_feedforward_layernorm.weight": (hidden,),
                f"{layer}.post_feedforward_layernorm.weight": (hidden,),
            }
        if config.qk_norm:
            shapes |= {
                f"{layer}.self_attn.q_norm.weight": (config.head_dim,),
                f"{layer}.self_attn.k_norm.weight": (config.head_dim,),
            }
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes
