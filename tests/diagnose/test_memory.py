"""`llmpipe memory`: the textbook figures, parameter counts against transformers, bytes by hand."""

import dataclasses
import json
import math

import pytest
import torch

from llmpipe.cli import main
from llmpipe.diagnose.memory import NAMED_ARCHITECTURES, plan_memory, weight_bytes
from llmpipe.quant.formats import weight_bytes_per_param

SEED_PARAMS = 7_000_000_000


@pytest.mark.parametrize(
    "dtype,quantization,seed_gb",
    [("float32", None, 28), ("float16", None, 14), ("bfloat16", None, 14), ("float16", "int8", 7),
     ("float16", "int4", 3.5)],
)
def test_seed_7b_weights_at_each_width(dtype, quantization, seed_gb):
    w = weight_bytes(NAMED_ARCHITECTURES["llama-7b"], dtype, quantization, params=SEED_PARAMS)
    assert w.params == SEED_PARAMS
    assert w.uniform == seed_gb * 10**9  # the textbook arithmetic is exact in decimal GB
    if quantization is None:
        assert w.resident == w.uniform
    else:  # scales and the float leftovers (norms, the untied embedding) cost a little more
        assert seed_gb * 10**9 < w.resident < 1.3 * seed_gb * 10**9


def test_seed_13b_kv_cache_per_token_and_at_4k():
    plan = plan_memory(NAMED_ARCHITECTURES["llama-13b"], "llama-13b", dtype="float16", context=4096)
    assert plan.kv_bytes_per_token == 2 * 40 * 5120 * 2 == 819_200  # K and V × layers × hidden × 2 bytes
    assert plan.kv_bytes_per_token / 2**20 == 0.78125  # the textbook "about 1 MiB"
    assert plan.kv_bytes_per_sequence == 819_200 * 4096
    assert plan.kv_bytes_per_sequence / 2**30 == 3.125  # the textbook "about 4 GiB"
    assert any("1 MiB" in note and "4 GiB" in note and "3.125 GiB" in note for note in plan.notes)


PUBLISHED = {"llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320, "qwen3-30b-a3b": 30_532_122_624,
             "gpt-oss-20b": 20_914_757_184, "gpt-oss-120b": 116_829_156_672}


@pytest.mark.parametrize("arch", sorted(NAMED_ARCHITECTURES))
def test_named_architectures_count_parameters_like_transformers(arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmpipe.loader.hf_config import hf_config_dict

    cfg = NAMED_ARCHITECTURES[arch]
    hf = AutoConfig.for_model(**hf_config_dict(cfg))  # the config.json llmpipe would write for it
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    expected = sum(p.numel() for p in model.parameters())
    assert weight_bytes(cfg, "float32").params == expected
    assert weight_bytes(cfg, "float16").resident == 2 * expected
    if arch in PUBLISHED:
        assert expected == PUBLISHED[arch]


def test_a_mixture_of_experts_reads_its_routed_experts_only():
    """Qwen3-30B-A3B: 8 of 128 experts a token, 3.35 B of 30.5 B parameters (Qwen's "A3B"), of which a token
    reads all but the embedding's other rows; a decode step of 16 tokens reads the experts any of them was
    routed to, 1 − (1 − 8/128)^16 of each layer's."""
    from llmpipe.diagnose import costs

    cfg = NAMED_ARCHITECTURES["qwen3-30b-a3b"]
    weights = weight_bytes(cfg, "bfloat16")
    experts, embedding = 48 * 128 * 3 * 2048 * 768, 151936 * 2048
    assert weights.active_params + embedding == weights.params - experts + experts * 8 // 128 == 3_353_032_704
    assert weights.active_resident == 2 * weights.active_params
    assert costs.active_fraction(cfg) == pytest.approx(weights.active_params / weights.params)
    share16 = 1 - (1 - 8 / 128) ** 16
    read16 = weights.params - embedding - experts * (1 - share16)
    assert costs.active_fraction(cfg, 16) == pytest.approx(read16 / weights.params)
    # a token's matmuls: the active parameters but the head (apart) and the norms
    assert costs.decoder_linear_params(cfg) == weights.active_params - 151936 * 2048 - 48 * (2 * 2048 + 2 * 128) - 2048
    dense = NAMED_ARCHITECTURES["llama3-8b"]
    assert weights_read(dense, 16) == weights_read(dense, 1) == 8_030_261_248 - 128256 * 4096


def weights_read(cfg, batch: int) -> float:
    from llmpipe.diagnose import costs

    return round(costs.active_fraction(cfg, batch) * weight_bytes(cfg, "float32").params)


def test_gpt_oss_counts_its_published_parameters():
    """gpt-oss-20b: 20.9 B parameters, 3.6 B active (OpenAI's count: 4 of 32 experts, no embedding); -120b:
    116.8 B and 5.1 B."""
    for arch, total, active in (("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)):
        weights = weight_bytes(NAMED_ARCHITECTURES[arch], "bfloat16")
        assert weights.params == pytest.approx(total, rel=1e-3) and weights.active_params == pytest.approx(active, rel=1e-2)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_bytes_cover_every_linear_and_the_head(quantization):
    """Llama 7B listed by hand: seven linears per layer and the LM head quantized; the untied
    embedding and the norms stay float16."""
    layers, hidden, inter, vocab = 32, 4096, 11008, 32000
    linears = [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter)]  # (out, in)

    def quantized(out: int, inp: int) -> float:
        return out * inp * weight_bytes_per_param(quantization, 2, 128, inp)

    expected = layers * sum(quantized(o, i) for o, i in linears) + quantized(vocab, hidden)
    expected += 2 * (vocab * hidden + (2 * layers + 1) * hidden)
    w = weight_bytes(NAMED_ARCHITECTURES["llama-7b"], "float16", quantization, group_size=128)
    assert w.resident == round(expected)
    assert w.quantized_params == layers * sum(o * i for o, i in linears) + vocab * hidden


def test_max_sequences_fill_the_memory_left_after_weights():
    cfg = NAMED_ARCHITECTURES["llama-13b"]
    memory = 40 * 2**30
    plan = plan_memory(cfg, "llama-13b", dtype="float16", context=4096, memory=memory, batch=5)
    weights = 2 * 13_015_864_320
    assert plan.max_sequences == (memory - weights) // (819_200 * 4096) == 5
    assert plan.fits
    assert not plan_memory(cfg, "llama-13b", dtype="float16", context=4096, memory=memory, batch=6).fits
    # int8 KV: 128 bytes + a 2-byte scale per head vector instead of 256 bytes
    int8 = plan_memory(cfg, "llama-13b", dtype="float16", kv_cache_dtype="int8", context=4096, memory=memory)
    assert int8.kv_bytes_per_token == 2 * 40 * 40 * (128 + 2)
    assert int8.max_sequences == (memory - weights) // (int8.kv_bytes_per_token * 4096)


def test_sequences_take_whole_blocks():
    plan = plan_memory(NAMED_ARCHITECTURES["llama-13b"], "llama-13b", dtype="float16", context=4100, block_size=16)
    assert plan.kv_bytes_per_sequence == math.ceil(4100 / 16) * 16 * 819_200
    assert any("4,112 slots" in note for note in plan.notes)


def test_memory_command_prints_the_seed_figures(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["memory", "--arch", "llama-13b", "--dtype", "float16", "--context", "4096", "--memory", "24GiB",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "819,200 B" in text and "3.125 GiB" in text and "does not fit" in text
    plan = json.loads(out.read_text())
    assert plan["kv_bytes_per_token"] == 819_200 and plan["max_sequences"] == 0 and plan["fits"] is False
    assert main(["memory", "--params", "7e9", "--dtype", "float32"]) == 0
    assert "28 GB" in capsys.readouterr().out


def test_memory_command_reads_a_checkpoint_config(capsys, tiny_checkpoint, tmp_path):
    directory = tiny_checkpoint("llama_gqa")
    config = json.loads((directory / "config.json").read_text())
    out = tmp_path / "plan.json"
    assert main(["memory", "--model", str(directory), "--context", "100", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert plan["kv_bytes_per_token"] == per_token
    assert plan["kv_bytes_per_sequence"] == 112 * per_token  # 100 tokens in 7 blocks of 16


@pytest.mark.parametrize("args,message", [
    (["--arch", "llama-7b", "--memory", "lots"], "--memory"),
    ([], "--model, --arch or --params"),
    (["--model", "/no/such/dir"], "/no/such/dir"),
])
def test_memory_errors_are_one_line(capsys, args, message):
    assert main(["memory", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("llmpipe: error:") and message in err[0]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_plan_matches_what_the_engine_holds(tiny_checkpoint, quantization):
    from llmpipe.llm import LLM

    llm = LLM(str(tiny_checkpoint("llama_gqa")), quantization=quantization, group_size=32, progress=False,
              kv_cache_memory="16MiB")
    planned = weight_bytes(llm.engine.config.model_config, "float32", quantization, group_size=32).resident
    if quantization is None:
        assert planned == llm.engine.weight_bytes
    else:  # the engine's packing (bf16 scales, padded row blocks) differs from the plan's by a little
        assert planned == pytest.approx(llm.engine.weight_bytes, rel=0.03)


def test_a_hybrid_counts_its_states_once_per_sequence_against_a_dense_model():
    """Qwen3.5-9B's shape: 24 Gated DeltaNet layers' conv and SSM states (float32, any length) beside 8 layers' K/V;
    at 32K tokens the cache is about a quarter of a dense model's of the same heads."""
    cfg = NAMED_ARCHITECTURES["qwen3.5-9b"]
    states = 24 * 4 * ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128)
    plan = plan_memory(cfg, "qwen3.5-9b", dtype="bfloat16", context=32768)
    assert plan.state_bytes_per_sequence == states
    assert plan.kv_bytes_per_token == 8 * 2 * 4 * 256 * 2
    assert plan.kv_bytes_per_sequence == 32768 * plan.kv_bytes_per_token + states
    at_32k = next(row for row in plan.hybrid if row.context == 32768)
    assert at_32k.dense_bytes == 4 * 32768 * plan.kv_bytes_per_token and at_32k.ratio <= 0.3


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_a_hybrids_plan_is_what_the_engine_holds_for_a_sequence(tiny_checkpoint, name):
    """The plan's per-sequence bytes (K/V in whole blocks, and the states) and its weights as the engine's own
    accounting gives them."""
    from llmpipe.llm import LLM

    llm = LLM(str(tiny_checkpoint(name)), progress=False, block_size=16)
    plan = plan_memory(llm.engine.config.model_config, "tiny", context=300)
    assert plan.state_bytes_per_sequence > 0 and plan.kv_bytes_per_sequence == llm.engine.kv_bytes_per_sequence(300)
    assert weight_bytes(llm.engine.config.model_config, "float32").resident == llm.engine.weight_bytes


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_a_hybrid_mixture_of_experts_reads_its_routed_experts_only(tiny_checkpoint, name):
    """Its parameters as transformers counts them; a token reads 2 of each sparse layer's 8 experts, all else."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmpipe.loader.hf_config import hf_model_config

    path = tiny_checkpoint(name)
    cfg = hf_model_config(path)
    with torch.device("meta"):
        expected = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).parameters())
    weights = weight_bytes(cfg, "float32")
    experts = sum(cfg.extra.moe.sparse_layers) * 8 * 3 * 48 * 64
    embedding = cfg.vocab_size * cfg.hidden_size
    assert weights.params == expected and weights.active_params == expected - embedding - experts + experts * 2 // 8


def test_the_processs_peak_counts_a_steps_activations():
    """A step of max_num_batched_tokens tokens (fewer where the batch holds fewer): about eight [tokens, hidden]
    float32 tensors, and the MLP's 3 × intermediate floats for at most MLP_CHUNK_ROWS rows at a time."""
    from llmpipe.diagnose.memory import RUNTIME_BYTES
    from llmpipe.engine.step_size import step_bytes
    from llmpipe.models.llama.model import MLP_CHUNK_ROWS

    cfg = NAMED_ARCHITECTURES["llama-7b"]
    plan = plan_memory(cfg, "llama-7b", dtype="float16", context=256, batch=16, max_num_batched_tokens=2048)
    assert plan.step_tokens == 2048
    assert plan.step_bytes == 4 * (8 * 2048 * 4096 + 3 * MLP_CHUNK_ROWS * 11008) == step_bytes(cfg, 2048)
    assert plan.process_bytes == RUNTIME_BYTES + plan.total_bytes + plan.step_bytes
    short = plan_memory(cfg, "llama-7b", dtype="float16", context=100, batch=1)
    assert short.step_tokens == 100 and short.step_bytes == 4 * (8 * 100 + 3 * 100 * 11008 / 4096) * 4096
    small = plan_memory(cfg, "llama-7b", dtype="float16", context=256, batch=16, max_num_batched_tokens=512)
    assert small.step_tokens == 512 and small.step_bytes == 4 * 512 * (8 * 4096 + 3 * 11008) < plan.step_bytes
    default = plan_memory(cfg, "llama-7b", dtype="float16", context=256, batch=16)
    assert default.step_tokens == 512  # the engine's default step for a 7B (engine/step_size)


@pytest.mark.parametrize("arch, tokens", [("llama-7b", 512), ("llama3-8b", 512), ("qwen3.5-9b", 512),
                                          ("gpt-oss-20b", 1024), ("qwen3-30b-a3b", 2048)])
def test_the_default_step_halves_from_2048_to_512_while_its_activations_pass_192_mib(arch, tokens):
    from llmpipe.engine.step_size import STEP_ACTIVATIONS_MAX, default_step_tokens, step_bytes

    cfg = NAMED_ARCHITECTURES[arch]
    assert default_step_tokens(cfg) == tokens
    assert tokens == 512 or step_bytes(cfg, tokens) <= STEP_ACTIVATIONS_MAX
    assert tokens == 2048 or step_bytes(cfg, 2 * tokens) > STEP_ACTIVATIONS_MAX


def test_small_models_keep_a_2048_token_step_and_an_engine_takes_its_models_default(smollm2_gguf):
    from llmpipe import LLM
    from llmpipe.engine.step_size import default_step_tokens
    from llmpipe.loader import load_checkpoint

    assert default_step_tokens(load_checkpoint(str(smollm2_gguf)).config) == 2048
    assert default_step_tokens(dataclasses.replace(NAMED_ARCHITECTURES["llama3-8b"], hidden_size=2048,
                                                   intermediate_size=8192)) == 2048  # Llama-3.2-1B's widths
    assert LLM(str(smollm2_gguf), progress=False).engine.config.max_num_batched_tokens == 2048
    assert LLM(str(smollm2_gguf), progress=False, max_num_batched_tokens=100).engine.config.max_num_batched_tokens == 100
