"""Whole models with quantized weights against transformers running the dequantized weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmpipe import LLM, SamplingParams
from llmpipe.quant.rtn import quantize_int4, quantize_int8
from tests.models.test_llama_parity import PROMPT

CASES = [("llama_gqa", "int4", 32), ("llama_mha", "int4", 64), ("qwen2", "int8", 128), ("qwen3", "int4", 128)]


def dequantized_reference(path, quantization: str, group: int) -> torch.nn.Module:
    """transformers' model with each linear weight replaced by its round-to-nearest dequantization."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            is_head = name == "lm_head"
            if isinstance(module, torch.nn.Linear) and (name.endswith("proj") or is_head):
                w = module.weight
                dq = quantize_int4(w, group).dequantize() if quantization == "int4" else quantize_int8(w).dequantize()
                w.copy_(dq)  # a tied head shares this tensor with the embedding, as llmpipe's does
    return model


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(map(str, c)))
def quantized_pair(request, tiny_checkpoint):
    name, quantization, group = request.param
    path = tiny_checkpoint(name)
    llm = LLM(str(path), quantization=quantization, group_size=group, activation_quantization=None, progress=False)
    return llm, dequantized_reference(path, quantization, group)


def test_prefill_logits_match_dequantized_transformers(quantized_pair):
    llm, reference = quantized_pair
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(llm.engine.score(PROMPT), theirs, atol=1e-4, rtol=0)  # GEMM path (20 rows)
    torch.testing.assert_close(llm.engine.score(PROMPT[:6]), theirs[:6], atol=1e-4, rtol=0)  # kernel path


def test_greedy_decode_matches_dequantized_transformers(quantized_pair):
    llm, reference = quantized_pair
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        theirs = reference.generate(
            torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0
        )[0, len(PROMPT):].tolist()
    assert ours == theirs


def test_quantized_weights_take_fewer_bytes(tiny_checkpoint):
    path = str(tiny_checkpoint("llama_gqa"))
    sizes = {q: LLM(path, quantization=q, group_size=32, progress=False).engine.weight_bytes for q in (None, "int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < sizes[None]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_default_sixteen_bit_activations_stay_near_the_dequantized_model(tiny_checkpoint, case):
    """The default ("auto"): 16-bit activation blocks in the integer-dot kernels wherever they run
    (decode-sized batches: here a 6-token prompt), near the dequantized model's logits."""
    from llmpipe.kernels import ops
    from llmpipe.quant.linear import QuantizedLinear

    if not ops.dot_available():
        pytest.skip("needs the integer-dot kernels")
    name, quantization, group = case
    path = tiny_checkpoint(name)
    llm = LLM(str(path), quantization=quantization, group_size=group, progress=False)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.activation_bits == 16 for m in layers)
    with torch.no_grad():
        theirs = dequantized_reference(path, quantization, group)(torch.tensor([PROMPT[:6]])).logits[0]
    torch.testing.assert_close(llm.engine.score(PROMPT[:6]), theirs, atol=1e-3, rtol=0)
