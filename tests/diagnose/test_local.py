"""`llmpipe diagnose --model`: real probe runs on a tiny checkpoint (and SmolLM2), checked against
references computed independently: the checkpoint's tensors, its config, torch's FLOP counter."""

import json
import statistics

import pytest
import torch
from safetensors import safe_open

from llmpipe.cli import main
from llmpipe.diagnose import costs
from llmpipe.diagnose.analysis import diagnose
from llmpipe.diagnose.local import engine_setup, measure_limits, run_probe
from llmpipe.llm import LLM
from llmpipe.sampling_params import SamplingParams

PREFILL_LEVERS = {"prefix caching", "shorter context"}
DECODE_LEVERS = {"quantize weights", "speculative decoding", "int8 KV cache"}


@pytest.fixture(scope="module")
def limits():
    return measure_limits()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama_gqa")


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    return LLM(str(tiny), progress=False, kv_cache_memory="64MiB")


def checkpoint_bytes(directory) -> int:
    total = 0
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        for name in f.keys():
            total += f.get_tensor(name).nbytes
    return total


def kv_bytes_per_token(directory) -> int:
    c = json.loads((directory / "config.json").read_text())
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"]) * 4


def test_verdict_flips_between_long_prompt_and_long_output(tiny_llm, limits):
    prefill = diagnose(*run_probe(tiny_llm, 900, 1), engine_setup(tiny_llm), limits)
    decode = diagnose(*run_probe(tiny_llm, 4, 200), engine_setup(tiny_llm), limits)
    assert prefill.bound == "prefill-bound" and prefill.verdict.startswith("prefill-bound: ")
    assert decode.bound == "decode-bound" and decode.verdict.startswith("decode-bound: ")
    assert prefill.split.decode_s == 0 and prefill.workload.output_len == 1
    assert decode.workload.output_len == 200
    assert next(lv for lv in prefill.levers if lv.metric == "request latency").name in PREFILL_LEVERS
    assert next(lv for lv in decode.levers if lv.metric == "request latency").name in DECODE_LEVERS


def test_decode_bytes_are_the_weights_plus_kv_read(tiny_llm, tiny, limits):
    prompt, output = 32, 40
    d = diagnose(*run_probe(tiny_llm, prompt, output), engine_setup(tiny_llm), limits)
    model = tiny_llm.engine.model
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers(recurse=True)]
               if t.data_ptr() not in {b.data_ptr() for b in model.model.rotary.buffers()}}
    weights = sum(t.nbytes for t in tensors.values())
    assert weights == checkpoint_bytes(tiny)  # the same float32 tensors the checkpoint holds
    # the decode step making token i (2…n) attends the prompt and the i - 1 tokens before it
    context = statistics.fmean(prompt + i - 1 for i in range(2, output + 1))
    untied_embedding = model.model.embed_tokens.weight.nbytes  # a token reads one row of it: none, to the roofline
    assert d.rates.decode_bytes_per_token == weights - untied_embedding + kv_bytes_per_token(tiny) * context
    assert 0 < d.rates.decode_bytes_per_s < limits.bandwidth
    assert 0 < d.rates.prefill_flops_per_s < limits.flops
    assert d.kv.bytes_per_token == kv_bytes_per_token(tiny)
    assert d.kv.capacity_sequences == tiny_llm.engine.stats().num_blocks // 5  # 72 tokens in 5 blocks of 16


def test_flop_counts_match_torch_flop_counter(tiny):
    """Counted on transformers' eager forward: one token (decode at context 1), and a prompt whose
    attention the counter takes as the full T × T square (causal attention needs the lower triangle)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from llmpipe.loader import load_checkpoint

    cfg = load_checkpoint(str(tiny)).config
    model = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="eager").eval()

    def counted(tokens: int) -> int:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.arange(1, tokens + 1)[None], logits_to_keep=1)
        return counter.get_total_flops()

    assert costs.decode_flops(cfg, 1) == counted(1)
    t = 50
    square_minus_triangle = costs.attention_flops(cfg, t * t - t * (t + 1) // 2)
    assert costs.prefill_flops(cfg, t) == counted(t) - square_minus_triangle


def test_offline_outputs_carry_their_timing_breakdown(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params)[0]
    t = out.metrics.timing_breakdown()
    assert t["output_tokens"] == len(out.outputs[0].token_ids) == 6
    assert t["queue_s"] + t["prefill_s"] == pytest.approx(t["ttft_s"])
    assert t["decode_s"] == pytest.approx(sum(out.metrics.itl))
    assert t["mean_itl_s"] == pytest.approx(t["decode_s"] / 5)


def test_diagnose_command_prints_verdict_and_writes_json(capsys, tiny, tmp_path):
    out = tmp_path / "diagnose.json"
    assert main(["diagnose", "--model", str(tiny), "--prompt-len", "8", "--output-len", "64",
                 "--kv-cache-memory", "64MiB", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verdict: decode-bound: " in text and "levers, by estimated gain" in text
    report = json.loads(out.read_text())
    assert report["bound"] == "decode-bound" and report["workload"]["output_len"] == 64
    assert report["rates"]["decode_bytes_per_s"] > 0 and report["levers"]


@pytest.mark.slow
def test_smollm2_prefill_and_decode_workloads(smollm2_gguf):
    llm = LLM(str(smollm2_gguf), progress=False)
    limits = measure_limits(model=llm.engine.model)  # its prefill runs the integer-dot panels
    setup = engine_setup(llm)
    prefill = diagnose(*run_probe(llm, 384, 1), setup, limits)
    # 64 tokens out after 16 in: decode outlasts the prefill several times over at any machine speed
    # (16-token prefill ~ 12 decode steps on the integer kernels: 24 tokens out was a near tie)
    decode = diagnose(*run_probe(llm, 16, 64), engine_setup(llm), limits)
    assert prefill.bound == "prefill-bound" and decode.bound == "decode-bound"
    context = 16 + 64 / 2
    assert decode.rates.decode_bytes_per_token == llm.engine.weight_bytes + setup.kv_bytes_per_token * context
    # The limits are measured minutes apart from the probes on a machine whose speed drifts by ±30%: a
    # rate past twice its limit means a miscount, one just past it only the drift (prefill measured
    # 97.2 GFLOP/s against a 94.3 peak once).
    assert 0 < decode.rates.decode_bytes_per_s < 2 * limits.bandwidth
    assert 0 < prefill.rates.prefill_flops_per_s < 2 * limits.flops
