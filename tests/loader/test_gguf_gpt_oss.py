"""A gpt-oss GGUF as llama.cpp's converter writes one (its GptOssModel): gate_up de-interleaved into gate and
up, every expert weight [experts, out, in] and bias [experts, out], sinks as `attn_sinks.weight`, the
post-attention norm as `post_attention_norm`, and the experts in MXFP4 (ggml's blocks) or float. Float, it is
transformers' model; MXFP4, it is transformers' model on the dequantized experts, each expert its own slice of
the file's blocks, read in place."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmpipe import LLM
from llmpipe.loader.gguf_quants import mxfp4_from_hf
from llmpipe.quant.linear import GGMLLinear
from tests.loader.gguf_helpers import hf_metadata, write_gguf
from tests.models.test_gpt_oss import random_mxfp4
from tests.models.parity_suite import GREEDY, PROMPT
from tests.utils import TINY_COMMON, TINY_CONFIGS, reference_greedy

ARCH = "gpt-oss"


@pytest.fixture(scope="module")
def reference():
    """The tiny gpt-oss as a GGUF can hold it: YaRN's ramp truncated to whole dimensions (a GGUF has no
    `truncate`; llama.cpp always truncates, ggml_rope_yarn_corr_dims) and the SwiGLU clamp at gpt-oss's 7 (the
    converter stores none; llama.cpp's graph has the constant)."""
    import transformers

    _, extra = TINY_CONFIGS["gpt_oss"]
    rope = {**extra["rope_parameters"], "truncate": True}
    config = transformers.GptOssConfig(**{**TINY_COMMON, **extra, "rope_parameters": rope, "swiglu_limit": 7.0})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.08 if param.dim() > 1 else 0.2) if not name.endswith("norm.weight") else None
    return model


def converter_tensors(model, mxfp4: bool) -> dict:
    """GGUF-named tensors, as convert_hf_to_gguf.py's GptOssModel writes them; with `mxfp4`, the experts'
    weights replaced by random MXFP4 ones (in the model too, dequantized, so both stay one model)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, model.config.num_hidden_layers)
    generator, tensors = torch.Generator().manual_seed(3), {}
    for hf_name, tensor in model.state_dict().items():
        prefix, _, kind = hf_name.rpartition(".")
        if kind in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            projection = kind.removesuffix("_bias")
            rows = tensor if kind.endswith("_bias") else tensor.transpose(1, 2)  # [experts, out, (in)]
            if mxfp4 and not kind.endswith("_bias"):
                blocks, scales = random_mxfp4(rows.shape[0], rows.shape[1], rows.shape[2], generator)
                with torch.no_grad():
                    tensor.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                rows = mxfp4_from_hf(blocks, scales)  # [experts, out, in / 32 × 17]
            parts = {"gate": rows[:, 0::2], "up": rows[:, 1::2]} if projection == "gate_up_proj" else {"down": rows}
            for part, data in parts.items():
                name = names.get_name(f"{prefix}.{part}_proj.{'bias' if kind.endswith('_bias') else 'weight'}",
                                      try_suffixes=(".weight", ".bias"))
                data = data.contiguous().numpy()
                tensors[name] = (data, Q.MXFP4) if data.dtype == np.uint8 else data
            continue
        if kind == "sinks":
            hf_name += ".weight"
        tensors[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = tensor.float().numpy()
    return tensors


def converter_metadata(config) -> dict:
    rope = config.rope_parameters
    return hf_metadata(config, ARCH) | {
        f"{ARCH}.expert_count": config.num_local_experts, f"{ARCH}.expert_used_count": config.num_experts_per_tok,
        f"{ARCH}.expert_feed_forward_length": config.intermediate_size,
        f"{ARCH}.attention.sliding_window": config.sliding_window,
        f"{ARCH}.rope.scaling.type": "yarn", f"{ARCH}.rope.scaling.factor": float(rope["factor"]),
        f"{ARCH}.rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        f"{ARCH}.rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
        f"{ARCH}.rope.scaling.yarn_beta_slow": float(rope["beta_slow"]),
    }


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_a_gpt_oss_gguf_is_transformers_model(reference, tmp_path, mxfp4):
    path = write_gguf(tmp_path / "gpt-oss.gguf", ARCH, converter_metadata(reference.config), converter_tensors(reference, mxfp4))
    """Logits with float activations (the exact path); greedy tokens with the default 16-bit activation blocks."""
    exact, llm = (LLM(str(path), progress=False, **options) for options in ({"activation_quantization": None}, {}))
    experts = llm.engine.model.model.layers[1].mlp.experts
    assert all(isinstance(e.gate_up_proj, GGMLLinear) for e in experts) == mxfp4
    assert [layer.self_attn.window for layer in llm.engine.model.model.layers] == [8, None, 8, None]
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(exact.engine.score(PROMPT), theirs, atol=1e-4, rtol=0)
    ours = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids
    assert ours == reference_greedy(reference, PROMPT)[0]
