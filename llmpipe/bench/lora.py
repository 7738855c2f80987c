"""`llmpipe bench lora`: what serving several LoRA adapters in one batch costs a decode step.

Four random adapters of rank 16 on all seven linear projections (PEFT's layout, written by hand to a temporary
folder: adapter_config.json and adapter_model.safetensors) load into one engine. The same batch of 16 requests
(the same prompts, greedy, a fixed output length) decodes base-only, then spread over the adapters (4 each by
default, optionally some base rows too), alternating for several rounds so a shared machine's drift falls on
both. Reported: the median decode step time (one token per request: the ITL) of each and mixed / base, the
issue's goal being <= 1.3 (docs/features/lora.md).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmpipe.lora.targets import LoRATargets
from llmpipe.sampling_params import SamplingParams

GOAL = 1.3  # issue 48: a step mixing 4 adapters at batch 16 costs at most this many times a base-only one


def write_random_adapter(model: torch.nn.Module, out: Path, rank: int, seed: int, alpha: float | None = None) -> Path:
    """A PEFT-shaped LoRA of `rank` on every linear projection of `model` (what PEFT saves for
    target_modules="all-linear"), with random factors scaled so the delta is a small part of each output."""
    targets = LoRATargets(model, rank)
    generator = torch.Generator().manual_seed(seed)
    tensors, names = {}, set()
    for checkpoint_name, (module_name, _, rows) in targets.shard_of.items():
        module = targets.modules[module_name]
        out_rows = len(range(module.out_features)[rows])
        key = f"base_model.model.{checkpoint_name}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) / module.in_features**0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(out_rows, rank, generator=generator) * 0.01
        names.add(checkpoint_name.rpartition(".")[2])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "target_modules": sorted(names),
              "bias": "none", "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def decode_step_times(engine, prompts: list[list[int]], loras: list[str | None], output_len: int) -> list[float]:
    """Add every prompt (each under its adapter), run them to the end, and return the times of the steps in
    which every request decoded (prefill steps left out)."""
    from llmpipe.engine.core_messages import EngineCoreRequest

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core = engine.core
    ids = [f"bench-{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt, lora in zip(ids, prompts, loras):
        core.add_request(EngineCoreRequest(request_id, prompt, params, lora_name=lora))
    times, started = [], set()
    while core.has_unfinished_requests():
        decoding = len(started) == len(prompts)
        begin = time.perf_counter()
        outputs = core.step()
        elapsed = time.perf_counter() - begin
        if decoding and len(core.scheduler.running) + sum(o.finished for o in outputs.outputs) == len(prompts):
            times.append(elapsed)
        started.update(o.request_id for o in outputs.outputs if o.new_token_ids)
    return times


def run_lora_bench(model: str = "smollm2-135m-instruct", batch: int = 16, adapters: int = 4, rank: int = 16,
                   base_rows: int = 0, prompt_len: int = 64, output_len: int = 64, rounds: int = 3,
                   output: str | None = "bench_results/lora.json", engine_options: dict | None = None) -> dict:
    from llmpipe import LLM

    options = {"max_num_seqs": max(batch, 16), **(engine_options or {})}
    llm = LLM(model, enable_lora=True, max_loras=adapters, max_lora_rank=rank, progress=False, **options)
    try:
        with tempfile.TemporaryDirectory(prefix="llmpipe-bench-lora-") as folder:
            names = [f"bench-{i}" for i in range(adapters)]
            for i, name in enumerate(names):
                llm.engine.core.loras.load(name, write_random_adapter(llm.engine.model, Path(folder) / name, rank, seed=i))
        vocab = llm.engine.config.model_config.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]
        mixed = [None if i < base_rows else names[(i - base_rows) % adapters] for i in range(batch)]
        runs = {"base": [None] * batch, "mixed": mixed}
        decode_step_times(llm.engine, prompts[:2], [None, names[0]], 4)  # warm-up: both paths once
        steps: dict[str, list[float]] = {kind: [] for kind in runs}
        per_round = []
        for round_ in range(rounds):
            medians = {}
            for kind, loras in runs.items():
                times = decode_step_times(llm.engine, prompts, loras, output_len)
                steps[kind] += times
                medians[kind] = statistics.median(times) * 1e3
            per_round.append({"round": round_, **{f"{k}_step_ms": round(v, 3) for k, v in medians.items()}})
        base_ms, mixed_ms = (statistics.median(steps[k]) * 1e3 for k in ("base", "mixed"))
        result = {
            "model": model, "batch": batch, "adapters": adapters, "rank": rank, "base_rows_in_mixed": base_rows,
            "prompt_len": prompt_len, "output_len": output_len, "rounds": rounds, "threads": torch.get_num_threads(),
            "base_step_ms": round(base_ms, 3), "mixed_step_ms": round(mixed_ms, 3),
            "base_tokens_per_s": round(batch / base_ms * 1e3, 1), "mixed_tokens_per_s": round(batch / mixed_ms * 1e3, 1),
            "ratio": round(mixed_ms / base_ms, 3), "goal": GOAL, "meets_goal": mixed_ms / base_ms <= GOAL,
            "per_round": per_round,
        }
    finally:
        llm.close()
    print(json.dumps(result, indent=2))
    print(f"decode step at batch {batch}: base {base_ms:.2f} ms, {adapters} adapters mixed {mixed_ms:.2f} ms, "
          f"ratio {mixed_ms / base_ms:.2f} (goal <= {GOAL})")
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(result, indent=2))
    return result
