"""The real SmolLM2-135M-Instruct Q4_1 GGUF: config, names and shapes, and transformers' own weights."""

from __future__ import annotations

import pytest
import torch

from llmpipe.loader.weight_names import expected_weight_shapes


def test_config_comes_from_gguf_metadata(smollm2):
    config = smollm2.config
    assert config.architecture == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert not config.attention_bias and not config.qk_norm and config.sliding_window is None
    assert smollm2.file_bytes == smollm2.path.stat().st_size


def test_every_hugging_face_weight_is_present_with_its_shape(smollm2, smollm2_weights):
    expected = expected_weight_shapes(smollm2.config)
    assert "lm_head.weight" not in expected  # tied
    assert list(smollm2_weights) == list(expected)
    for name, weight in smollm2_weights.items():
        assert tuple(weight.shape) == expected[name], name
        assert weight.dtype == torch.float32, name


def test_checkpoint_carries_the_gguf_tokenizer(smollm2):
    assert smollm2.tokenizer is not None
    assert smollm2.tokenizer.vocab_size == smollm2.config.vocab_size


def test_raw_blocks_unpermuted_then_dequantized_equal_the_weight(smollm2, smollm2_weights):
    from llmpipe.loader.gguf_quants import dequantize

    name = "model.layers.3.self_attn.k_proj.weight"
    qtype, raw = smollm2.source.raw_blocks(name)
    assert qtype.name == "Q4_1" and raw.dtype == torch.uint8
    assert torch.equal(dequantize(raw, qtype, (192, 576)), smollm2_weights[name])


@pytest.fixture(scope="module")
def transformers_state_dict(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.state_dict()


@pytest.mark.slow
def test_every_weight_equals_transformers_gguf_dequantized_and_unpermuted(
    smollm2_weights, transformers_state_dict
):
    reference = dict(transformers_state_dict)
    assert torch.equal(reference.pop("lm_head.weight"), reference["model.embed_tokens.weight"])  # tied
    assert set(smollm2_weights) == set(reference)
    for name, weight in smollm2_weights.items():
        assert torch.equal(weight, reference[name]), name
