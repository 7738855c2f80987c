"""`llmpipe bench realsize` without its slow parts: the real shapes' parameter counts, the tensor-by-tensor
writer on a tiny shape read back by transformers, the AMX-safe llama.cpp flags and the report (no network,
no llama.cpp build)."""

from __future__ import annotations

import dataclasses
import argparse
import json
import stat
import sys

import pytest
from safetensors import safe_open

from llmpipe.bench import peers, realsize
from llmpipe.bench.realsize_checkpoint import SHAPES, shard_groups, synthetic_bpe, write_checkpoint


@pytest.mark.parametrize("name, billions", [("llama-3.2-1b", 1.236), ("llama-3.2-3b", 3.213),
                                             ("llama-3.1-8b", 8.030), ("qwen2.5-7b", 7.616)])
def test_the_shapes_have_the_published_parameter_counts(name, billions):
    assert SHAPES[name].parameters() / 1e9 == pytest.approx(billions, abs=0.001)


def test_the_moe_shape_is_qwen3_30b_a3b_per_layer():
    """12 of 48 layers: the whole model's 30.53 B parameters and 3.3 B active a token, scaled by layers."""
    shape = SHAPES["qwen3-30b-a3b-12l"]
    embeddings = 2 * shape.vocab * shape.hidden  # untied: embedding and head, outside the layers
    assert (shape.parameters() - embeddings) * 4 + embeddings == pytest.approx(30.532e9, rel=1e-3)
    config = shape.config()
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"], config["head_dim"]) == (
        128, 8, 768, 128)


def test_the_gpt_oss_shape_is_gpt_oss_20b_whole():
    """24 layers of 32 experts (MXFP4 blocks counted as their weights): OpenAI's 20.91 B parameters."""
    shape = SHAPES["gpt-oss-20b"]
    assert shape.parameters() == 20_914_757_184
    config = shape.config()
    assert config["quantization_config"]["quant_method"] == "mxfp4" and config["layer_types"][:2] == [
        "sliding_attention", "full_attention"]


def test_a_tiny_gpt_oss_checkpoint_in_openais_layout_loads_in_llmpipe(tmp_path):
    """Its MXFP4 experts (random codes and exponents) load as ggml MXFP4 and the model runs."""
    from llmpipe import LLM, SamplingParams

    shape = dataclasses.replace(SHAPES["gpt-oss-20b"], hidden=64, intermediate=64, layers=2, heads=4, kv_heads=2,
                                vocab=640, regular_tokens=600, special_tokens=40, explicit_head_dim=16, experts=4,
                                experts_per_token=2, expert_intermediate=64, max_position=512)
    out = write_checkpoint(shape, tmp_path / "gpt-oss", shard_bytes=20_000, progress=False)
    llm = LLM(str(out), progress=False)
    assert type(llm.engine.model.model.layers[1].mlp.experts[3].down_proj).__name__ == "GGMLLinear"
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4


def test_llama_3_rope_and_tied_embeddings_are_as_published():
    small, big, qwen = SHAPES["llama-3.2-1b"].config(), SHAPES["llama-3.1-8b"].config(), SHAPES["qwen2.5-7b"].config()
    assert small["rope_scaling"]["rope_type"] == "llama3" and small["rope_scaling"]["factor"] == 32.0
    assert big["rope_scaling"]["factor"] == 8.0 and big["rope_theta"] == 500000.0
    assert small["tie_word_embeddings"] and not big["tie_word_embeddings"] and not qwen["tie_word_embeddings"]
    assert qwen["vocab_size"] == 152064 and big["vocab_size"] == 128256 and qwen["rope_theta"] == 1e6


def test_shards_hold_a_few_tensors_each():
    tensors = list(SHAPES["llama-3.1-8b"].tensors())
    groups = shard_groups(tensors, 1 << 30)
    assert sum(len(g) for g in groups) == len(tensors)
    for group in groups:
        size = sum(2 * _numel(shape) for _, shape in group)
        assert size <= 1 << 30 or len(group) == 1


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_the_synthetic_bpe_has_the_exact_size_and_consistent_merges():
    vocab, merges = synthetic_bpe(1000, seed=3)
    assert len(vocab) == 1000 and len(merges) == 1000 - 256
    assert all(a in vocab and b in vocab and vocab[a + b] > max(vocab[a], vocab[b]) for a, b in merges)


@pytest.mark.parametrize("base", ["llama-3.2-1b", "qwen2.5-7b", "qwen3-30b-a3b-12l", "qwen3.5-9b"])
def test_a_tiny_checkpoint_written_tensor_by_tensor_loads_in_transformers(tmp_path, base):
    import transformers

    moe = dict(explicit_head_dim=32, experts=4, experts_per_token=2, expert_intermediate=48) if SHAPES[base].experts else {}
    hybrid = dict(explicit_head_dim=32, linear=(2, 4, 16, 16), layers=4) if SHAPES[base].hybrid else {}  # one full layer
    shape = dataclasses.replace(SHAPES[base], **{**dict(hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, vocab=640,
                                                        regular_tokens=600, special_tokens=16), **moe, **hybrid})
    out = write_checkpoint(shape, tmp_path / base, shard_bytes=20_000, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    names = dict(shape.tensors())
    assert set(index["weight_map"]) == set(names) and len(set(index["weight_map"].values())) > 2
    for name, filename in index["weight_map"].items():
        with safe_open(str(out / filename), "pt") as f:
            assert tuple(f.get_slice(name).get_shape()) == names[name]
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.model_type, config.hidden_size, config.num_key_value_heads, config.vocab_size) == (
        shape.model_type, 64, 2, 640)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.numel() for p in model.parameters()) == shape.parameters()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == 616 and tokenizer.convert_tokens_to_ids(shape.specials()[0]) == 600


def test_amx_is_turned_off_only_where_the_cpu_has_it(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert peers.cpu_has_amx(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert not peers.cpu_has_amx(cpuinfo)
    with_amx = peers.cmake_flags(amx=True)
    assert "-DGGML_NATIVE=ON" in with_amx and "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in with_amx
    assert not any("amx" in flag for flag in peers.cmake_flags(amx=False))


def test_llama_bench_runs_only_the_kinds_asked(tmp_path):
    fake = tmp_path / "bin" / "llama-bench"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    """case "$*" in *"-p 0 -n 128"*) echo '[{"avg_ts": 9.5}]';; *) exit 1;; esac\n""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert peers.llama_bench(tmp_path / "m.gguf", 2, 512, 128, cache=tmp_path, kinds=("tg",)) == {
        "tg128": 9.5, "tg128_flags": ""}


def test_a_child_process_peak_rss_is_its_own():
    done = realsize.run_measured([sys.executable, "-c", "b = bytearray(200 << 20); print('ok')"])
    assert done.returncode == 0 and done.stdout.strip() == "ok"
    assert done.max_rss > 200 << 20


def test_a_mixture_of_experts_roofline_counts_the_bytes_a_token_reads(tmp_path):
    """A token reads its k of E experts of each `*_exps` tensor and no row but its own of an untied embedding;
    decode's share of the roofline counts those bytes, not the whole file's."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from tests.loader.gguf_helpers import write_gguf

    f32 = lambda *shape: np.zeros(shape, dtype=np.float32)  # noqa: E731
    tensors = {"token_embd.weight": f32(100, 64), "output.weight": f32(100, 64), "blk.0.attn_q.weight": f32(64, 64),
               "blk.0.ffn_up_exps.weight": (f32(8, 32, 64), Q.Q8_0)}
    path = write_gguf(tmp_path / "moe.gguf", "qwen3moe", {"qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2}, tensors)
    expected = 100 * 64 * 4 + 64 * 64 * 4 + 8 * 32 * 64 // 32 * 34 * 2 // 8
    assert realsize.bytes_per_token(path) == expected
    row = {"model": "qwen3-30b-a3b-12l", "file_bytes": 5e9, "bytes_per_token": 1e9,
           "llmpipe": {"tg": 20.0}, "llama.cpp": {"tg": 10.0}}
    realsize.add_ratios(row, bandwidth=20e9)
    assert row["llmpipe"]["tg_of_roofline"] == pytest.approx(1.0)


def test_the_table_puts_the_engines_side_by_side_with_ratios_and_roofline(tmp_path):
    row = {"model": "llama-3.2-1b", "type": "Q8_0", "file_bytes": 1_000_000_000,
           "llmpipe": {"load_s": 2.0, "peak_rss": 2 << 30, "tg": 10.0, "pp": 100.0,
                       "batched": {"total_tokens_per_s": 80.0}},
           "llama.cpp": {"load_s": 1.0, "peak_rss": 1 << 30, "tg": 20.0, "error": "pp512 failed",
                         "batched": {"total_tokens_per_s": 40.0}}}
    realsize.add_ratios(row, bandwidth=40e9)
    assert row["ratios"] == {"load_s": 2.0, "peak_rss": 2.0, "tg": 0.5, "batched": 2.0}
    assert row["llmpipe"]["tg_of_roofline"] == pytest.approx(0.25)
    table = realsize.markdown_table([row])
    assert "| llama-3.2-1b | Q8_0 | 0.93 | 2.0 / 1.0 (2.00x) |" in table
    assert "predicts" not in table  # no prediction in the row
    row["predicted_peak_rss"] = 1.9 * 2**30
    assert ("llama-3.2-1b Q8_0: `llmpipe memory` predicts a peak of 1.90 GiB, the run's was 2.00 (-5%)"
            in realsize.markdown_table([row]))
    assert "10.0 / 20.0 (0.50x) | 25% / 50% | 100.0 / - (512) |" in table
    assert "llama-3.2-1b Q8_0 llama.cpp: pp512 failed" in table
    earlier = tmp_path / "realsize.json"
    earlier.write_text(json.dumps({"results": [dict(row, type="Q4_K_M"), dict(row, note="old")]}))
    assert [(r["type"], r.get("note")) for r in realsize.merged(earlier, [row])] == [("Q8_0", None), ("Q4_K_M", None)]


def test_each_activation_numerics_gets_a_row_against_one_llama_cpp_run(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    calls = []
    monkeypatch.setattr(realsize, "bytes_per_token", lambda path: 1000)
    monkeypatch.setattr(realsize, "predicted_peak_rss", lambda path, kv, step: calls.append(("predicted", step)))
    monkeypatch.setattr(realsize, "run_llmpipe", lambda *a: calls.append(a[6:]) or {"tg": {"auto": 9.0, "int8": 12.0}[a[6]]})
    monkeypatch.setattr(realsize, "run_llama_cpp", lambda *a: calls.append("llama.cpp") or {"tg": 10.0})
    args = argparse.Namespace(kv_cache_memory="1GiB", prefill_tokens=512, threads=2, skip=[], repetitions=1,
                              activations=["auto", "int8"], max_num_batched_tokens=512)
    rows = realsize.bench_file("llama-3.2-1b", "Q4_K_M", gguf, args, bandwidth=1e9)
    assert calls == [("auto", 512), ("int8", 512), "llama.cpp", ("predicted", 512)]  # each engine run at the step asked
    assert rows[0]["max_num_batched_tokens"] == 512
    assert [(r["activations"], r["ratios"]["tg"]) for r in rows] == [("auto", 0.9), ("int8", 1.2)]
    table = realsize.markdown_table(rows)
    assert "| llama-3.2-1b | Q4_K_M |" in table and "| llama-3.2-1b (int8 activations) | Q4_K_M |" in table
    assert [r["activations"] for r in realsize.merged(tmp_path / "none.json", rows)] == ["auto", "int8"]


def test_the_predicted_peak_holds_the_weights_the_engine_holds_and_the_pool(smollm2_gguf):
    """The run's prediction: the runtime, the weights as the engine itself counts them once loaded, the KV pool
    whole and a step of the engine's max_num_batched_tokens."""
    from llmpipe import LLM
    from llmpipe.diagnose.memory import RUNTIME_BYTES, step_bytes

    llm = LLM(str(smollm2_gguf), progress=False, kv_cache_memory="64MiB")
    config = llm.engine.config
    step = step_bytes(config.model_config, config.max_num_batched_tokens)
    assert realsize.predicted_peak_rss(smollm2_gguf, "64MiB") == RUNTIME_BYTES + llm.engine.weight_bytes + (64 << 20) + step
