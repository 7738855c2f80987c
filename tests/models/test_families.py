"""The family registry: which family serves an architecture, and what each derives from its meta-device model
(checkpoint tensors and shapes, the linear weights quantization converts), checked against the tensors the
tiny transformers checkpoints actually hold."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from safetensors import safe_open

from llmpipe.errors import UnsupportedModelError
from llmpipe.loader.hf_config import hf_model_config
from llmpipe.models.deepseek_v4 import DEEPSEEK_V4
from llmpipe.models.gemma3 import GEMMA3
from llmpipe.models.llama import LLAMA
from llmpipe.models.qwen3_5 import QWEN3_5
from llmpipe.models.qwen3_5_moe import QWEN3_5_MOE
from llmpipe.models.qwen3_moe import QWEN3_MOE
from llmpipe.models.qwen3_next import QWEN3_NEXT
from llmpipe.models.registry import FAMILIES, family_of, gguf_architecture
from tests.utils import TINY_CONFIGS, gpt_oss_expert_slices, split_fused_projections


def saved_shapes(directory) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors (gpt-oss's 3-D experts as each expert's own: tests/utils.gpt_oss_expert_slices;
    Qwen3-Next's fused projections as Qwen3.5's four: tests/utils.split_fused_projections)."""
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        tensors = gpt_oss_expert_slices({name: f.get_tensor(name) for name in f.keys()})
    config = json.loads((directory / "config.json").read_text())
    if config["model_type"] == "qwen3_next":
        tensors = split_fused_projections(tensors, SimpleNamespace(**config))
    return {name: tuple(tensor.shape) for name, tensor in tensors.items()}


@pytest.mark.parametrize(("architecture", "family"), [
    ("llama", LLAMA), ("mistral", LLAMA), ("qwen2", LLAMA), ("qwen3", LLAMA),
    ("gemma3_text", GEMMA3), ("gemma3", GEMMA3), ("deepseek_v4", DEEPSEEK_V4),
    ("qwen3_moe", QWEN3_MOE), ("qwen3moe", QWEN3_MOE), ("qwen2_moe", QWEN3_MOE), ("qwen2moe", QWEN3_MOE),
    ("qwen3_5_text", QWEN3_5), ("qwen3_5", QWEN3_5), ("qwen35", QWEN3_5),
    ("qwen3_5_moe_text", QWEN3_5_MOE), ("qwen3_5_moe", QWEN3_5_MOE), ("qwen35moe", QWEN3_5_MOE),
    ("qwen3_next", QWEN3_NEXT), ("qwen3next", QWEN3_NEXT),
])
def test_each_architecture_belongs_to_one_family(architecture, family):
    assert family_of(architecture) is family
    assert sum(architecture in f.architectures for f in FAMILIES) == 1


def test_an_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match=r"architecture 'olmo2' is not supported \(supported: llama, "
                                                    r"mistral, qwen2, qwen3, gemma3_text, gemma3, deepseek_v4, phi3, "
                                                    r"qwen2_moe, qwen3_moe, qwen2moe, qwen3moe, gpt_oss, gpt-oss, "
                                                    r"qwen3_5_text, qwen3_5, qwen35, qwen3_5_moe_text, qwen3_5_moe, "
                                                    r"qwen35moe, qwen3_next, qwen3next\)"):
        family_of("olmo2")


def test_an_unknown_gguf_architecture_is_refused_naming_the_supported_ones(tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"GGUF architecture 'phi3' is not supported "
                                                    r"\(supported: llama, qwen2, qwen3, gemma3, qwen2moe, qwen3moe, gpt-oss, "
                                                    r"qwen35, qwen35moe, qwen3next\)"):
        gguf_architecture("phi3", tmp_path)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_weight_shapes_are_the_tensors_transformers_saves(tiny_checkpoint, name):
    directory = tiny_checkpoint(name)
    config = hf_model_config(directory)
    assert family_of(config.architecture).weight_shapes(config) == saved_shapes(directory)


def test_deepseek_v4_weight_shapes_are_the_tensors_transformers_saves(tiny_deepseek_v4):
    directory = tiny_deepseek_v4()
    config = hf_model_config(directory)
    assert DEEPSEEK_V4.weight_shapes(config) == saved_shapes(directory)


@pytest.mark.parametrize("name", ["qwen2", "llama_gqa"])
def test_llama_linear_weights_are_every_projection_the_embedding_and_the_head(tiny_checkpoint, name):
    config = hf_model_config(tiny_checkpoint(name))
    names = LLAMA.weight_shapes(config)
    expected = [n for n in names if n.endswith("proj.weight") or n in ("model.embed_tokens.weight", "lm_head.weight")]
    assert LLAMA.linear_weights(config) == expected  # no norms, no biases
    assert ("lm_head.weight" in expected) is not config.tie_word_embeddings


def test_deepseek_v4_linear_weights_leave_out_the_grouped_projection_experts_and_router(tiny_deepseek_v4):
    config = hf_model_config(tiny_deepseek_v4())
    linear = set(DEEPSEEK_V4.linear_weights(config))
    layer = "model.layers.1."  # a CSA layer: compressor and indexer too
    assert {f"{layer}attn.{w}.weight" for w in ("wq_a", "wq_b", "wkv", "wo_b", "compressor.wkv", "compressor.wgate",
                                                "indexer.wq_b", "indexer.weights_proj")} <= linear
    assert {f"{layer}ffn.shared_experts.w{i}.weight" for i in (1, 2, 3)} <= linear
    assert {"head.weight", "model.embed_tokens.weight"} <= linear
    assert not {f"{layer}attn.wo_a.weight", f"{layer}ffn.gate.weight", f"{layer}ffn.experts.0.w1.weight",
                f"{layer}attn_norm.weight"} & linear
