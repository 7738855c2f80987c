"""llama.cpp GGUF LoRA files (written as its convert_lora_to_gguf.py writes them: tests/lora/helpers.py) giving
PEFT's merged model, on a float base and on a base GGUF whose weights stay quantized (K-quant blocks in
GGMLLinear, float activations) against PEFT merged into the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from llmpipe import LLM
from llmpipe.errors import UnsupportedModelError
from llmpipe.lora import LoRAManager
from llmpipe.quant.linear import GGMLLinear
from tests.loader.gguf_helpers import WIDE_LLAMA, hf_metadata, hf_tensors, llama_cpp_permute, write_gguf
from tests.loader.test_gguf_quants import random_blocks
from tests.lora.helpers import merged_logits, save_peft_adapter, write_gguf_lora

TOKENS = [1, 17, 250, 33, 91, 5, 160, 77, 300, 12, 64, 128]


def score(llm, manager: LoRAManager, name: str | None) -> torch.Tensor:
    with manager.step([name] * len(TOKENS)):
        return llm.engine.score(TOKENS)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16], ids=["f32", "f16"])
def test_gguf_lora_gives_the_peft_adapters_logits(lora_base, lora_llm, tmp_path, qtype):
    base_dir, base = lora_base
    peft_dir = save_peft_adapter(base, tmp_path / "peft", seed=21, r=8, alpha=16)
    gguf_path = write_gguf_lora(tmp_path / "lora.gguf", peft_dir, base.config, qtype=qtype)
    manager = LoRAManager(lora_llm.engine.model, max_loras=2, max_lora_rank=8)
    from_gguf, from_peft = manager.load("gguf", gguf_path), manager.load("peft", peft_dir)
    assert set(from_gguf.modules) == set(from_peft.modules)
    for module, factors in from_peft.modules.items():  # the same factors, q / k rows of B back in HF order
        tolerance = 0 if qtype == Q.F32 else 2e-3
        torch.testing.assert_close(from_gguf.modules[module].b, factors.b, atol=tolerance, rtol=0)
    ours = score(lora_llm, manager, "gguf")
    expected = merged_logits(base, peft_dir, TOKENS)
    torch.testing.assert_close(ours, expected, atol=1e-4 if qtype == Q.F32 else 2e-2, rtol=0)
    torch.testing.assert_close(ours, score(lora_llm, manager, "peft"), atol=1e-4 if qtype == Q.F32 else 2e-2, rtol=0)


def test_a_gguf_that_is_not_a_lora_adapter_is_refused(lora_base, lora_llm, tmp_path):
    config = lora_base[1].config
    path = write_gguf(tmp_path / "model.gguf", "llama", hf_metadata(config, "llama"),
                      hf_tensors(lora_base[1].state_dict(), config, "llama", {}))
    manager = LoRAManager(lora_llm.engine.model)
    with pytest.raises(UnsupportedModelError, match="not a GGUF LoRA adapter"):
        manager.load("model", path)


# K-quant blocks are random bytes with scales of this size (gguf-py cannot quantize to them); Q8_0 is quantized.
RANDOM_SCALES = {Q.Q4_K: 0.002, Q.Q6_K: 0.0001}


@pytest.fixture(scope="module")
def quantized_base(tmp_path_factory):
    """A WIDE_LLAMA GGUF (q, k, o, gate and up in Q4_K, v in Q6_K, down in Q8_0) and the transformers model
    holding its weights as gguf-py dequantizes them (PEFT's base for the adapters and the reference)."""
    import gguf
    import transformers

    config = transformers.LlamaConfig(**WIDE_LLAMA)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.05)
    tensors = hf_tensors(model.state_dict(), config, "llama", {})  # float, q / k rows permuted as llama.cpp's
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    state = dict(model.state_dict())
    for seed, name in enumerate(state):
        qtype = next((q for parts, q in (("q_proj k_proj o_proj gate_proj up_proj", Q.Q4_K), ("v_proj", Q.Q6_K),
                                         ("down_proj", Q.Q8_0)) if any(f".{p}." in name for p in parts.split())), None)
        if qtype is None:
            continue
        raw = (quants.quantize(state[name].numpy(), qtype) if qtype == Q.Q8_0
               else random_blocks(qtype, seed, tuple(state[name].shape), RANDOM_SCALES[qtype]))
        state[name] = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))
        if ".q_proj." in name:  # whole rows of blocks move, as the converter's permute moves the float rows
            raw = llama_cpp_permute(raw, config.num_attention_heads, config.num_attention_heads)
        elif ".k_proj." in name:
            raw = llama_cpp_permute(raw, config.num_attention_heads, config.num_key_value_heads)
        tensors[name_map.get_name(name, try_suffixes=(".weight",))] = (raw, qtype)
    path = write_gguf(tmp_path_factory.mktemp("quantized_base") / "base.gguf", "llama", hf_metadata(config, "llama"), tensors)
    model.load_state_dict(state)
    return path, model


def test_adapters_on_a_quantized_gguf_base_equal_peft_merged_into_its_dequantized_weights(quantized_base, tmp_path):
    path, dequantized = quantized_base
    llm = LLM(str(path), activation_quantization=None, progress=False)
    layers = llm.engine.model.model.layers
    assert all(isinstance(m, GGMLLinear) for layer in layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    peft_dir = save_peft_adapter(dequantized, tmp_path / "peft", seed=31, r=8, alpha=16)
    qv_dir = save_peft_adapter(dequantized, tmp_path / "qv", seed=32, r=4, alpha=8, targets=["q_proj", "v_proj"])
    manager = LoRAManager(llm.engine.model, max_loras=3, max_lora_rank=8)
    manager.load("peft", peft_dir)
    manager.load("gguf", write_gguf_lora(tmp_path / "qv.gguf", qv_dir, dequantized.config))
    base_logits = merged_logits(dequantized, None, TOKENS)
    torch.testing.assert_close(score(llm, manager, None), base_logits, atol=1e-4, rtol=0)
    for name, adapter in (("peft", peft_dir), ("gguf", qv_dir)):
        expected = merged_logits(dequantized, adapter, TOKENS)
        assert (expected - base_logits).abs().max() > 0.05
        torch.testing.assert_close(score(llm, manager, name), expected, atol=1e-4, rtol=0, msg=name)
