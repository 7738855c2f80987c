"""Qwen3.5-MoE through the engine against transformers (float32, tests/utils.py's tiny checkpoint: a Gated DeltaNet,
the gated attention and another Gated DeltaNet, each with 8 experts, 2 a token, and a shared expert): the shared
parity suite, chunks cut anywhere, prefix-cache hits under preemption; the config, Qwen's 3-D experts (in a
multimodal directory) read as transformers' per-expert ones, the config llmpipe writes, the options refused.
(Its GGUF: tests/loader/test_gguf_hybrid_moe.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmpipe.config import EngineConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.loader import load_checkpoint
from llmpipe.loader.hf_config import hf_config_dict, hf_model_config
from llmpipe.models.qwen3_5_moe import QWEN3_5_MOE
from llmpipe.models.registry import family_of
from tests.models.hybrid_suite import *  # noqa: F403  (the hybrids' shared tests)
from tests.models.parity_suite import *  # noqa: F403  (the shared parity tests)
from tests.utils import reference_case

LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3_5_moe")


@pytest.fixture(scope="module")
def case(checkpoint):
    return reference_case(checkpoint)


def test_config_reads_the_linear_attention_and_the_experts(checkpoint):
    config = hf_model_config(checkpoint)
    assert family_of(config.architecture) is QWEN3_5_MOE and config.layer_types == LAYER_TYPES
    moe = config.extra.moe
    sizes = (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.shared_expert_intermediate_size)
    assert sizes == (8, 2, 48, 80)
    assert moe.norm_topk_prob and moe.sparse_layers == (True,) * 3  # Qwen3.5-MoE's router always renormalizes
    assert config.extra.linear_num_value_heads == 4 and QWEN3_5_MOE.routing(config) == (8, 2)


def test_experts_quantize_and_the_routers_stay_float(checkpoint):
    linear = QWEN3_5_MOE.linear_weights(hf_model_config(checkpoint))
    assert {"model.layers.0.mlp.experts.7.gate_proj.weight", "model.layers.1.mlp.shared_expert.down_proj.weight",
            "model.layers.0.linear_attn.in_proj_qkv.weight"} <= set(linear)
    assert not {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight"} & set(linear)


def qwen_layout_copy(checkpoint: Path, out: Path) -> Path:
    """The checkpoint as Qwen publishes Qwen3.5-MoE: a multimodal directory, the text model under model.language_model.,
    each layer's experts as 3-D gate_up_proj [experts, 2 × inner, hidden] and down_proj [experts, hidden, inner]
    (no .weight), beside vision tensors and an MTP block whose experts are per-expert."""
    saved = load_file(checkpoint / "model.safetensors")
    tensors = {name.replace("model.", "model.language_model.", 1): t for name, t in saved.items() if ".experts." not in name}
    for layer in range(3):
        def stacked(part: str) -> torch.Tensor:
            return torch.stack([saved[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"] for e in range(8)])

        prefix = f"model.language_model.layers.{layer}.mlp.experts."
        tensors |= {prefix + "gate_up_proj": torch.cat([stacked("gate_proj"), stacked("up_proj")], 1),
                    prefix + "down_proj": stacked("down_proj")}
    unread = ("model.visual.patch_embed.weight", "mtp.layers.0.mlp.experts.0.up_proj.weight")
    tensors |= {name: torch.ones(2, 2) for name in unread}
    out.mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": config, "vision_config": {}}))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_qwens_3d_experts_load_as_transformers_per_expert_ones(checkpoint, tmp_path):
    saved, qwen = load_checkpoint(str(checkpoint)), load_checkpoint(str(qwen_layout_copy(checkpoint, tmp_path / "qwen")))
    assert qwen.config.architecture == "qwen3_5_moe"
    assert {**vars(qwen.config), "architecture": "qwen3_5_moe_text"} == vars(saved.config)
    for (name, tensor), (saved_name, saved_tensor) in zip(qwen.iter_weights(), saved.iter_weights(), strict=True):
        assert name == saved_name and torch.equal(tensor, saved_tensor)


def test_the_config_llmpipe_writes_reads_back(checkpoint, tmp_path):
    config = hf_model_config(checkpoint)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(config)))
    assert hf_model_config(tmp_path) == config


@pytest.mark.parametrize(("options", "refusal"), [
    (dict(speculative_method="ngram"), "speculative decoding"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
])
def test_engine_options_it_cannot_run_with_are_refused(options, refusal):
    with pytest.raises(UnsupportedModelError, match=refusal):
        QWEN3_5_MOE.check_engine_options(EngineConfig(**options))
