"""The real Gemma 3 270M GGUF (Q4_K_M, dequantized to float32) against transformers loading the same file, and
its Q4_K / Q5_0 / Q6_K / Q8_0 tensors kept quantized against that dequantized model."""

from __future__ import annotations

import pytest
import torch

from gguf import GGMLQuantizationType as Q

from llmpipe import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]
NEAR_TIE = 0.01  # transformers' top-2 logit margin below which either token is a fair greedy pick


@pytest.fixture(scope="module")
def reference(gemma3_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32)
    return model.eval()


def test_config_and_cache_groups_follow_transformers_reading_of_the_gguf(gemma3_llm, reference):
    cfg, hf = gemma3_llm.engine.config.model_config, reference.config
    assert cfg.architecture == "gemma3" and cfg.layer_types == tuple(hf.layer_types)
    assert cfg.sliding_window == hf.sliding_window == 512
    assert cfg.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert cfg.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar and cfg.tie_word_embeddings
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (18, 1, 256)
    layout = gemma3_llm.engine.kv_layout
    assert [g.spec.name for g in layout.groups] == ["sliding_window(512)"] * 5 + ["full"]
    assert layout.groups[-1].layers == (5, 11, 17)
    assert 106 in gemma3_llm.engine.eos_token_ids  # <end_of_turn> ends a chat reply, as in llama.cpp


def test_norm_weights_are_loaded_without_llama_cpp_plus_one(gemma3_llm, reference):
    ours = gemma3_llm.engine.model.model.layers[3].post_feedforward_layernorm.weight
    torch.testing.assert_close(ours, reference.model.layers[3].post_feedforward_layernorm.weight, atol=0, rtol=0)


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_64_tokens_match_transformers_up_to_the_first_near_tie(gemma3_llm, reference, text):
    ids = gemma3_llm.get_tokenizer().encode(text)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ours = gemma3_llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    expected = out.sequences[0, len(ids) :].tolist()
    margins = [float(step[0].topk(2).values.diff().abs()) for step in out.logits]
    until = next((i for i, m in enumerate(margins) if m < NEAR_TIE), 64)
    assert until >= 8, f"near-tie at step {until}: pick a less ambiguous prompt"
    assert ours[:until] == expected[:until]


# Measured max |Δlogit| against the dequantized model on PROMPTS and the dense model's 32-token continuations: up to
# 4e-5 with float activations (float32 rounding: another summation order; 0 in the latest measurement), 0.013 with
# the default 16-bit activation blocks; bounds with margin.
NATIVE_ATOL = {None: 1e-3, "auto": 0.05}
# Greedy tokens decoded per prompt. Float activations dequantize each weight a slice of rows at a time with gguf-py
# (the reference path), ~0.8 s a token for the 262144-row head on one thread: a few tokens prove their decode
# steps, and the scoring of the dense model's continuation checks every later position's logits in one pass.
DECODED = {None: 4, "auto": 32}


@pytest.mark.parametrize("activations", list(NATIVE_ATOL), ids=["float activations", "default"])
def test_q4_k_and_q5_0_tensors_run_quantized_and_compute_the_dequantized_model(gemma3_gguf, gemma3_llm, activations):
    native = LLM(str(gemma3_gguf), progress=False, activation_quantization=activations)
    layer = native.engine.model.model.layers[0]
    segments = lambda module: [t for t, _, _ in module.segments]  # noqa: E731
    assert segments(layer.self_attn.qkv_proj) == [Q.Q5_0, Q.Q5_0, Q.Q8_0]  # the file's blocks: Q5_0 q, k and a Q8_0 v
    assert segments(layer.mlp.gate_up_proj) == [Q.Q5_0, Q.Q5_0]
    assert segments(native.engine.model.model.layers[2].self_attn.qkv_proj) == [Q.Q5_0] * 3  # q, k and v Q5_0
    assert segments(layer.self_attn.o_proj) == [Q.Q4_K]
    assert segments(native.engine.model.lm_head) == [Q.Q8_0]  # the tied embedding
    assert native.engine.weight_bytes < 0.6 * gemma3_llm.engine.weight_bytes
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for text in PROMPTS:
        ids = gemma3_llm.get_tokenizer().encode(text)
        dense = gemma3_llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
        logits = gemma3_llm.engine.score(ids + dense)
        torch.testing.assert_close(native.engine.score(ids + dense), logits, atol=NATIVE_ATOL[activations], rtol=0)
        decoded = SamplingParams(temperature=0.0, max_tokens=DECODED[activations], ignore_eos=True)
        ours = native.generate([{"prompt_token_ids": ids}], decoded)[0].outputs[0].token_ids
        top2 = logits[len(ids) - 1 : -1].topk(2, dim=-1).values
        until = next((i for i, m in enumerate((top2[:, 0] - top2[:, 1]).tolist()) if m < NEAR_TIE), len(dense))
        agreed = min(until, len(ours))
        assert ours[:agreed] == dense[:agreed]
