"""`llmpipe bench breakdown`: where a batch-1 decode step's time goes — the transformer layers, the
LM head, and the rest of the engine step (scheduling, metadata, embedding, sampling, detokenizing) —
layer by layer (the per-op path) and through the fused decode step, in one run.

Each variant's model is loaded once and decoded both ways, alternating, so the machine's drift hits
both alike; each figure is the median over `--repeats` runs of its mean over the decode steps.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

from llmpipe.bench.latency import VARIANTS
from llmpipe.bench.report import format_table, random_prompt, write_json
from llmpipe.llm import LLM
from llmpipe.sampling_params import SamplingParams

PATHS = {"layer by layer": False, "fused decode step": True}


@contextmanager
def timed(obj, attribute: str, into: list[float]):
    """Append the wall time of every call of obj.attribute to `into` while inside."""
    original = getattr(obj, attribute)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    setattr(obj, attribute, wrapper)
    try:
        yield
    finally:
        delattr(obj, attribute)  # the instance attribute goes; the class's method shows again


def decode_steps(llm: LLM, prompt: list[int], tokens: int) -> dict[str, float]:
    """Mean ms per decode step of: the whole step, the layers, the LM head, and the rest (the first,
    prefill step dropped; means, so the parts add up to the step)."""
    model, engine = llm.engine.model, llm.engine
    layers, head, steps = [], [], []
    with timed(model.model, "forward", layers), timed(model, "compute_logits", head), timed(engine, "step", steps):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                     use_tqdm=False)
    ms = lambda values: 1000 * statistics.fmean(values[1:])  # noqa: E731
    step, body, lm_head = ms(steps), ms(layers), ms(head)
    return {"step_ms": step, "layers_ms": body, "lm_head_ms": lm_head, "rest_ms": step - body - lm_head}


def run(args) -> dict:
    report = {"model": args.model, "tokens": args.tokens, "variants": {}}
    for name in args.variants:
        llm = LLM(args.model, progress=False, **VARIANTS[name].engine_options(args.group_size))
        prompt = random_prompt(llm.engine.config.model_config.vocab_size, 16, seed=0)
        decode_steps(llm, prompt, 8)  # warm-up: kernels built, pages touched
        samples: dict[str, list[dict]] = {path: [] for path in PATHS}
        for _ in range(args.repeats):
            for path, fused in PATHS.items():
                llm.engine.model.model.fused_decode = fused
                samples[path].append(decode_steps(llm, prompt, args.tokens))
        llm.engine.model.model.fused_decode = True
        report["variants"][name] = {
            path: {key: statistics.median(s[key] for s in runs) for key in runs[0]} for path, runs in samples.items()
        }
    return report


def breakdown_table(report: dict) -> str:
    rows = [["variant", "path", "step (ms)", "layers (ms)", "LM head (ms)", "rest (ms)", "tok/s", "vs layer by layer"]]
    for name, paths in report["variants"].items():
        base = paths["layer by layer"]["step_ms"]
        for path, r in paths.items():
            rows.append([name, path, f"{r['step_ms']:.2f}", f"{r['layers_ms']:.2f}", f"{r['lm_head_ms']:.2f}",
                         f"{r['rest_ms']:.2f}", f"{1000 / r['step_ms']:.1f}", f"{base / r['step_ms']:.2f}x"])
    return format_table(rows)


def main(args) -> None:
    report = run(args)
    print(breakdown_table(report))
    print(f"wrote {write_json(args.output, report)}")
