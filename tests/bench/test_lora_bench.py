"""`llmpipe bench lora` on a tiny model: it writes PEFT-shaped adapters the engine loads, times decode-only
steps of both batches, and reports their ratio."""

from __future__ import annotations

import json

from llmpipe.bench.lora import run_lora_bench, write_random_adapter
from llmpipe.lora import LoRAManager


def test_the_lora_bench_times_base_and_mixed_decode_steps(tiny_checkpoint, tmp_path):
    out = tmp_path / "lora.json"
    result = run_lora_bench(str(tiny_checkpoint("llama_gqa")), batch=4, adapters=2, rank=4, base_rows=1, prompt_len=8,
                            output_len=4, rounds=1, output=str(out), engine_options={"num_threads": 1})
    assert json.loads(out.read_text()) == result
    assert result["base_step_ms"] > 0 and result["mixed_step_ms"] > 0
    assert abs(result["ratio"] - result["mixed_step_ms"] / result["base_step_ms"]) < 0.01 * result["ratio"]


def test_its_random_adapters_cover_every_linear_projection(tiny_checkpoint, tmp_path):
    from llmpipe import LLM

    with LLM(str(tiny_checkpoint("llama_gqa")), progress=False) as llm:
        adapter = LoRAManager(llm.engine.model, max_loras=1, max_lora_rank=4).load(
            "a", write_random_adapter(llm.engine.model, tmp_path / "a", rank=4, seed=0))
    assert {name.rpartition(".")[2] for name in adapter.modules} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert adapter.rank == 4
