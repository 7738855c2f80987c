"""DeepSeek V4's parts outside attention against transformers' modules on the same tiny random weights:
config parsing, RoPE frequencies, mixture of experts (hash and top-k routing), hyper-connections, the
decoder layer's non-attention path, checkpoint loading and the float32 parameters of a bfloat16 model."""

from __future__ import annotations

import copy
import json

import pytest
import safetensors.torch
import torch
import transformers
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as reference

from llmpipe import LLM
from llmpipe.config import ModelConfig
from llmpipe.errors import UnsupportedModelError
from llmpipe.models.deepseek_v4.hyper_connection import HyperConnection, HyperHead
from llmpipe.models.deepseek_v4.moe import DeepseekV4MoE
from llmpipe.layers.rotary import rope_attention_factor, rope_inv_freq
from llmpipe.loader import load_checkpoint
from llmpipe.loader.hf_config import hf_model_config
from llmpipe.loader.weight_names import expected_weight_shapes
from llmpipe.models import build_model
from llmpipe.models.deepseek_v4.model import DeepseekV4DecoderLayer
from llmpipe.quant.rtn import quantize_int8
from tests.utils import TINY_DEEPSEEK_V4, tiny_deepseek_v4_model

TOKENS = 24
# The published checkpoints' spelling: compress_ratios (with the MTP layer's entry last), num_hash_layers,
# qk_rope_head_dim, n_routed_experts, a flat legacy rope_scaling for the compressed layers.
PUBLISHED = {
    "model_type": "deepseek_v4", "vocab_size": 320, "hidden_size": 64, "moe_intermediate_size": 48,
    "num_hidden_layers": 4, "num_hash_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_lora_rank": 16, "o_groups": 2,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.5, "rope_theta": 10000, "compress_rope_theta": 40000,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 128,
                     "beta_fast": 16, "beta_slow": 2},
    "compress_ratios": [0, 4, 128, 4, 0], "sliding_window": 8, "max_position_embeddings": 512,
    "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4, "hc_mult": 2, "hc_sinkhorn_iters": 7,
    "hc_eps": 1e-5, "swiglu_limit": 7.0, "norm_topk_prob": True, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
}
# Next to nothing given: transformers' defaults fill the rest (layer schedule, hash layers, RoPE fraction).
SPARSE = {
    "model_type": "deepseek_v4", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 5,
    "num_attention_heads": 4, "head_dim": 32, "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
}


def parsed(hf_config: transformers.DeepseekV4Config | dict, tmp_path) -> ModelConfig:
    """llmpipe's reading of a config.json: save_pretrained's, or the dict as written."""
    if isinstance(hf_config, dict):
        (tmp_path / "config.json").write_text(json.dumps(hf_config))
    else:
        hf_config.save_pretrained(tmp_path)
    return hf_model_config(tmp_path)


def assert_config_matches(ours: ModelConfig, hf: transformers.DeepseekV4Config) -> None:
    v4, rope = ours.extra, hf.rope_parameters
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "sliding_window",
                  "tie_word_embeddings", "hidden_act", "bos_token_id"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.eos_token_ids == (hf.eos_token_id,)
    for field in ("compress_rates", "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
                  "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "num_experts_per_tok",
                  "routed_scaling_factor", "scoring_func", "swiglu_limit"):
        assert getattr(v4, field) == getattr(hf, field), field
    assert (v4.layer_types, v4.mlp_layer_types) == (tuple(hf.layer_types), tuple(hf.mlp_layer_types))
    assert (v4.num_experts, v4.rope_head_dim) == (hf.n_routed_experts, hf.qk_rope_head_dim)
    assert (ours.rope_theta, ours.rope_scaling) == (rope["main"]["rope_theta"], None)
    assert v4.compress_rope_theta == rope["compress"]["rope_theta"]
    main = reference.DeepseekV4RotaryEmbedding.compute_default_rope_parameters(hf, layer_type="main")[0]
    torch.testing.assert_close(rope_inv_freq(v4.rope_head_dim, ours.rope_theta, None).float(), main)
    compress, factor = ROPE_INIT_FUNCTIONS[rope["compress"]["rope_type"]](hf, layer_type="compress")
    ours_compress = rope_inv_freq(v4.rope_head_dim, v4.compress_rope_theta, v4.compress_rope_scaling)
    torch.testing.assert_close(ours_compress.float(), compress)
    assert rope_attention_factor(v4.compress_rope_scaling) == factor == 1.0


def test_saved_config_reads_as_transformers_reads_it(tmp_path):
    hf = transformers.DeepseekV4Config(**TINY_DEEPSEEK_V4)
    assert_config_matches(parsed(hf, tmp_path), hf)


@pytest.mark.parametrize("raw", [PUBLISHED, SPARSE], ids=["published", "sparse"])
def test_other_spellings_read_as_transformers_reads_them(raw, tmp_path):
    ours = parsed(raw, tmp_path)
    assert_config_matches(ours, transformers.DeepseekV4Config(**raw))
    assert ours.extra.compress_rope_scaling["rope_type"] == "yarn"


@pytest.mark.parametrize("change", [{"scoring_func": "softmax"}, {"hidden_act": "gelu"}, {"n_shared_experts": 2}])
def test_unsupported_settings_are_refused(change, tmp_path):
    with pytest.raises(UnsupportedModelError):
        parsed({**PUBLISHED, **change}, tmp_path)


# ---- modules against transformers' (float32) -----------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' tiny model, llmpipe's ModelConfig of it)."""
    model = tiny_deepseek_v4_model()
    return model, parsed(model.config, tmp_path_factory.mktemp("v4_config"))


def with_reference_weights(ours: nn.Module, ref: nn.Module) -> nn.Module:
    """ours holding ref's weights: the same names, but the shared expert's gate and up stacked."""
    state = dict(ref.state_dict())
    for key in [k for k in state if k.endswith("shared_experts.gate_proj.weight")]:
        prefix = key.removesuffix("gate_proj.weight")
        state[f"{prefix}gate_up_proj.weight"] = torch.cat([state.pop(key), state.pop(f"{prefix}up_proj.weight")])
    ours.load_state_dict(state)
    return ours.eval()


def inputs(config: ModelConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, config.hidden_size, generator=generator)
    return x, torch.randint(0, config.vocab_size, (TOKENS,), generator=generator)


def random_streams(config: ModelConfig, dtype: torch.dtype, seed: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, config.extra.hc_mult, config.hidden_size, generator=generator).to(dtype)


@pytest.mark.parametrize("layer", [0, 1], ids=["hash_moe", "topk_moe"])
def test_moe_matches_transformers(pair, layer):
    ref_model, config = pair
    ref = ref_model.model.layers[layer].mlp
    ours = with_reference_weights(DeepseekV4MoE(config, layer), ref)
    x, ids = inputs(config)
    with torch.no_grad():
        expected = ref(x[None], input_ids=ids[None])[0]
        torch.testing.assert_close(ours(x, ids), expected, atol=1e-5, rtol=1e-5)
        gate_up = torch.nn.functional.linear(x, ref.experts.gate_up_proj[0])
        assert (gate_up.abs() > config.extra.swiglu_limit).any()  # the clamps take part


def test_router_correction_bias_changes_the_choice(pair):
    """The top-k router picks by score + bias and weighs by score alone: the bias must matter here."""
    ref_model, config = pair
    ours = with_reference_weights(DeepseekV4MoE(config, 1), ref_model.model.layers[1].mlp)
    x, ids = inputs(config)
    with torch.no_grad():
        _, chosen = ours.gate(x, ids)
        ours.gate.e_score_correction_bias.zero_()
        _, unbiased = ours.gate(x, ids)
    assert not torch.equal(chosen.sort(-1).values, unbiased.sort(-1).values)


def test_hyper_connection_matches_transformers(pair):
    ref_model, config = pair
    ref = ref_model.model.layers[2].attn_hc
    ours = with_reference_weights(HyperConnection(config), ref)
    streams = random_streams(config, torch.float32, seed=2)
    with torch.no_grad():
        for mine, theirs in zip(ours(streams), ref(streams[None])):
            torch.testing.assert_close(mine, theirs[0], atol=1e-6, rtol=1e-5)


def test_hyper_head_matches_transformers(pair):
    ref_model, config = pair
    ours = with_reference_weights(HyperHead(config), ref_model.model.hc_head)
    streams = random_streams(config, torch.float32, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(ours(streams), ref_model.model.hc_head(streams[None])[0], atol=1e-6, rtol=1e-5)


class StubAttention(nn.Module):
    """One fixed function of the normed input for both implementations: tanh(x W)."""

    def __init__(self, hidden: int, reference_signature: bool):
        super().__init__()
        self.weight = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(4)) / hidden**0.5
        self.reference_signature = reference_signature

    def forward(self, x, *args, **kwargs):
        out = torch.tanh(x.float() @ self.weight).to(x.dtype)
        return (out, None) if self.reference_signature else out


def stubbed(layer: nn.Module, reference_signature: bool) -> nn.Module:
    layer.self_attn = StubAttention(layer.input_layernorm.weight.shape[0], reference_signature)
    return layer


@pytest.mark.parametrize("layer", [0, 3], ids=["hash_moe", "topk_moe"])
def test_decoder_layer_around_attention_matches_transformers(pair, layer):
    ref_model, config = pair
    ref = stubbed(copy.deepcopy(ref_model.model.layers[layer]), reference_signature=True)
    ours = with_reference_weights(stubbed(DeepseekV4DecoderLayer(config, layer), reference_signature=False), ref)
    streams, (_, ids) = random_streams(config, torch.float32), inputs(config)
    with torch.no_grad():
        expected = ref(streams[None], input_ids=ids[None])[0]
        torch.testing.assert_close(ours(streams, ids, None, None, None, None), expected, atol=1e-5, rtol=1e-5)


# ---- the checkpoint ------------------------------------------------------------------------------------


def reference_name(ours: str) -> str:
    return ours.replace("shared_experts.gate_up_proj", "shared_experts.gate_proj")


def test_every_checkpoint_tensor_lands_in_its_parameter(tiny_deepseek_v4):
    path = tiny_deepseek_v4()
    checkpoint = load_checkpoint(str(path))
    saved = safetensors.torch.load_file(path / "model.safetensors")
    assert set(expected_weight_shapes(checkpoint.config)) == set(saved)  # nothing missing, nothing left over
    model = build_model(checkpoint.config, checkpoint.iter_weights(), torch.float32, "cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    ours = model.state_dict()
    for name, tensor in ours.items():
        if "shared_experts.gate_up_proj" in name:
            gate, up = ref[reference_name(name)], ref[name.replace("gate_up_proj", "up_proj")]
            assert torch.equal(tensor, torch.cat([gate, up])), name
        else:
            assert torch.equal(tensor, ref[name]), name
    assert len(ours) == len(ref) - sum("shared_experts.up_proj" in k for k in ref)


def test_multi_token_prediction_tensors_are_ignored(tiny_deepseek_v4, tmp_path):
    source = tiny_deepseek_v4()
    for item in source.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = safetensors.torch.load_file(source / "model.safetensors")
    tensors["mtp.0.ffn.gate.weight"] = torch.zeros(4, 64)
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    checkpoint = load_checkpoint(str(tmp_path))
    build_model(checkpoint.config, checkpoint.iter_weights(), torch.float32, "cpu")


# ---- bfloat16 --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_pair(tiny_deepseek_v4):
    path = tiny_deepseek_v4()
    checkpoint = load_checkpoint(str(path))
    ours = build_model(checkpoint.config, checkpoint.iter_weights(), torch.bfloat16, "cpu")
    return ours, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(), checkpoint.config


def test_bfloat16_model_keeps_transformers_float32_parameters(bf16_pair):
    ours, ref, _ = bf16_pair
    ref_state = ref.state_dict()
    dtypes = {name: t.dtype for name, t in ours.state_dict().items()}
    assert dtypes == {name: ref_state[reference_name(name)].dtype for name in dtypes}
    assert {torch.float32, torch.bfloat16, torch.int64} == set(dtypes.values())


@pytest.mark.parametrize("layer", [0, 1], ids=["hash_moe", "topk_moe"])
def test_bfloat16_decoder_layer_around_attention_matches_transformers(bf16_pair, layer):
    ours_model, ref_model, config = bf16_pair
    ours = stubbed(copy.deepcopy(ours_model.model.layers[layer]), reference_signature=False)
    ref = stubbed(copy.deepcopy(ref_model.model.layers[layer]), reference_signature=True)
    streams, (_, ids) = random_streams(config, torch.bfloat16), inputs(config)
    with torch.no_grad():
        expected = ref(streams[None], input_ids=ids[None])[0]
        torch.testing.assert_close(ours(streams, ids, None, None, None, None), expected, atol=2e-2, rtol=2e-2)


def test_int8_model_matches_transformers_on_the_dequantized_linears(tiny_deepseek_v4):
    """quantization="int8" rounds every linear layer (the routed experts and the grouped wo_a are no linear
    layers: they stay float), as transformers does running those weights dequantized."""
    path = tiny_deepseek_v4()
    prompt = list(range(1, 34))
    ours = LLM(str(path), progress=False, block_size=4, quantization="int8").engine.score(prompt)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("o_a_proj"):
                module.weight.copy_(quantize_int8(module.weight).dequantize())
        torch.testing.assert_close(ours, ref(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)
