"""`llmpipe quantize` on tiny checkpoints: the files follow the GPTQ / AWQ layouts, load back, and
compute what transformers computes with the weights unpacked from the files by the layouts' definitions."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from llmpipe import LLM, SamplingParams
from llmpipe.cli import main
from llmpipe.eval.perplexity import TEXT
from llmpipe.quant.quantize import quantize_model
from tests.quant.conftest import CALIBRATION, GROUP
from tests.quant.reference import reference_awq_weight, reference_gptq_weight

PROMPT = [1, 17, 250, 33, 91, 5, 160, 77, 300, 12, 64, 128, 3, 99, 201, 45, 18, 260, 7, 150]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
CASES = [("llama_gqa", "gptq", False), ("llama_gqa", "gptq", True), ("llama_mha", "awq", False),
         ("qwen2", "gptq", True), ("qwen2", "awq", False), ("llama_gqa", "rtn", False)]


def read_tensors(directory) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_gptq_directory_layout(quantized_dir):
    directory = quantized_dir("llama_gqa", "gptq", True)
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization_config"] | {"damp_percent": None} == {
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False, "damp_percent": None,
        "true_sequential": False, "static_groups": False, "checkpoint_format": "gptq",
    }
    tensors = read_tensors(directory)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    groups = -(-inter // GROUP)  # 112 inputs in groups of 32: the last one holds 16
    prefix = "model.layers.1.mlp.down_proj"
    assert f"{prefix}.weight" not in tensors
    assert tensors[f"{prefix}.qweight"].dtype == torch.int32 and tensors[f"{prefix}.qweight"].shape == (inter // 8, hidden)
    assert tensors[f"{prefix}.qzeros"].dtype == torch.int32 and tensors[f"{prefix}.qzeros"].shape == (groups, hidden // 8)
    assert tensors[f"{prefix}.scales"].dtype == torch.float16 and tensors[f"{prefix}.scales"].shape == (groups, hidden)
    assert tensors[f"{prefix}.g_idx"].dtype == torch.int32 and sorted(tensors[f"{prefix}.g_idx"].tolist()) == [
        i // GROUP for i in range(inter)
    ]
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {p.name for p in directory.iterdir()}


def test_awq_directory_layout(quantized_dir):
    directory = quantized_dir("llama_mha", "awq")
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
    }
    tensors = read_tensors(directory)
    q_dim, hidden = config["num_attention_heads"] * config["head_dim"], config["hidden_size"]
    prefix = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{prefix}.qweight"].shape == (hidden, q_dim // 8)
    assert tensors[f"{prefix}.qzeros"].shape == (hidden // GROUP, q_dim // 8)
    assert tensors[f"{prefix}.scales"].shape == (hidden // GROUP, q_dim)
    assert f"{prefix}.g_idx" not in tensors


def reference_model(tiny_checkpoint, name: str, directory) -> torch.nn.Module:
    """transformers' model with every tensor taken from the quantized directory, the quantized
    linears dequantized by the reference unpacking."""
    tensors = read_tensors(directory)
    method = json.loads((directory / "config.json").read_text())["quantization_config"]["quant_method"]
    state = {}
    for key, tensor in tensors.items():
        prefix, part = key.rsplit(".", 1)
        if part in ("qzeros", "scales", "g_idx"):
            continue
        if part == "qweight":
            qzeros, scales = tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"]
            if method == "gptq":
                state[f"{prefix}.weight"] = reference_gptq_weight(tensor, qzeros, scales, tensors[f"{prefix}.g_idx"])
            else:
                state[f"{prefix}.weight"] = reference_awq_weight(tensor, qzeros, scales, GROUP)
        else:
            state[key] = tensor
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(name), dtype=torch.float32).eval()
    assert all(f"model.layers.0.{linear}.weight" in state for linear in LINEARS)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing)  # lm_head only when tied
    return model


@pytest.mark.parametrize("name,method,act_order", CASES)
def test_quantized_directory_computes_what_transformers_computes_on_its_weights(
    tiny_checkpoint, quantized_dir, name, method, act_order
):
    directory = quantized_dir(name, method, act_order)
    ours = LLM(str(directory), progress=False, quantization=None).engine.score(PROMPT)
    with torch.no_grad():
        theirs = reference_model(tiny_checkpoint, name, directory)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    original = LLM(str(tiny_checkpoint(name)), progress=False, quantization=None).engine.score(PROMPT)
    assert not torch.allclose(ours, original, atol=1e-3)  # the weights really are quantized


@pytest.mark.parametrize("quantization", [None, "auto"], ids=["dequantized", "int4 layers"])
def test_llm_generates_from_a_quantized_directory(quantized_dir, quantization):
    llm = LLM(str(quantized_dir("llama_gqa", "gptq", True)), progress=False, quantization=quantization)
    out = llm.generate(["the quick brown fox"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"


@pytest.fixture(scope="module")
def outlier_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny Llama with three channels of every RMSNorm weight 20x larger: activations with the
    outlier channels real LLMs have (and calibration exists for)."""
    directory = Path(shutil.copytree(tiny_checkpoint("llama_gqa"), tmp_path_factory.mktemp("outliers") / "model"))
    tensors = read_tensors(directory)
    gen = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        if name.endswith("layernorm.weight"):
            tensor[torch.randperm(tensor.numel(), generator=gen)[:3]] *= 20
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def held_out_logprobs(directory) -> torch.Tensor:
    llm = LLM(str(directory), progress=False, quantization=None)
    ids = llm.get_tokenizer().encode(TEXT.read_text(encoding="utf-8"))[:1024]
    return torch.cat([llm.engine.score(ids[start : start + 128]).log_softmax(-1) for start in range(0, 1024, 128)])


def test_calibrated_methods_stay_closer_to_the_float_model_than_round_to_nearest(outlier_checkpoint, tmp_path):
    """Calibrated on Othello, measured on Hamlet: mean KL(float ‖ quantized) of next-token distributions."""
    reference = held_out_logprobs(outlier_checkpoint)
    kl = {}
    for method in ("rtn", "gptq", "awq"):
        quantize_model(str(outlier_checkpoint), method, tmp_path / method, group_size=GROUP, progress=False, **CALIBRATION)
        logprobs = held_out_logprobs(tmp_path / method)
        kl[method] = (reference.exp() * (reference - logprobs)).sum(-1).mean().item()
    assert kl["rtn"] > 0.01  # round-to-nearest really hurts here
    assert kl["gptq"] < 0.75 * kl["rtn"] and kl["awq"] < 0.75 * kl["rtn"], kl


def test_quantize_and_eval_commands(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "q"
    argv = ["quantize", "--model", str(tiny_checkpoint("llama_gqa")), "--method", "awq", "--group-size", "16",
            "--num-samples", "2", "--seq-len", "32", "--out", str(out)]
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 16
    assert main(["eval", "perplexity", "--model", str(out), "--context", "32", "--stride", "16", "--max-tokens", "100"]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_quantize_reports_a_calibration_text_too_short(tiny_checkpoint, tmp_path, capsys):
    calib = tmp_path / "short.txt"
    calib.write_text("the quick brown fox")
    argv = ["quantize", "--model", str(tiny_checkpoint("llama_gqa")), "--method", "gptq", "--calib", str(calib),
            "--seq-len", "64", "--out", str(tmp_path / "q")]
    assert main(argv) == 1
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]  # after the loading bars
    assert last == "llmpipe: error: the calibration text has 4 tokens, fewer than seq_len=64"
