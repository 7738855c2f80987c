"""`llmpipe bench latency`: TTFT and batch-1 decode speed, against transformers and the roofline.

Every figure is measured in this run: the machine's bandwidth, llmpipe's variants (dtype,
KV cache on/off) and transformers' generate() on the same weights.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from llmpipe.bench import roofline
from llmpipe.bench.report import format_table, random_prompt, write_json
from llmpipe.llm import LLM
from llmpipe.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Variant:
    name: str
    dtype: str = "float32"
    kv_cache: bool = True
    quantization: str | None = None  # None: float weights in `dtype`; "auto": a GGUF's Q4/Q8 kept as stored
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1  # > 1: the machine's threads are shared out among the ranks
    activation_quantization: str | None = None  # "int8": the integer-dot kernels

    def engine_options(self, group_size: int) -> dict:
        return dict(dtype=self.dtype, kv_cache=self.kv_cache, quantization=self.quantization,
                    group_size=group_size, kv_cache_dtype=self.kv_cache_dtype,
                    tensor_parallel_size=self.tensor_parallel_size,
                    activation_quantization=self.activation_quantization)


TTFT_TRIALS = 3  # TTFT is the best of a few prefills (distinct prompts, so no prefix-cache hit)


def ttft_samples(llm: LLM, length: int, trials: int = TTFT_TRIALS) -> list[float]:
    vocab = llm.engine.config.model_config.vocab_size
    return [run_llmpipe(llm, random_prompt(vocab, length, seed=100 + t), 1)["ttft_s"] for t in range(trials)]


def run_llmpipe(llm: LLM, prompt_ids: list[int], new_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params)[0]
    return {"ttft_s": out.metrics.ttft, "decode_tokens_per_s": out.metrics.decode_tokens_per_s, "itl_s": out.metrics.itl}


def estimate_recompute_rate(llm: LLM, prompt_ids: list[int], new_tokens: int, samples: int = 8) -> float:
    """Decode tokens/s without a KV cache, where running every step is too slow: time the recompute
    step (a forward over the whole sequence so far) at evenly spaced lengths and average."""
    total_len = len(prompt_ids) + new_tokens
    ids = random_prompt(llm.engine.config.model_config.vocab_size, total_len, seed=1)
    lengths = [len(prompt_ids) + 1 + round(i * (new_tokens - 1) / (samples - 1)) for i in range(samples)]
    step_times = []
    for length in lengths:
        start = time.perf_counter()
        llm.engine.score(ids[:length], last_only=True)
        step_times.append(time.perf_counter() - start)
    return 1.0 / (sum(step_times) / len(step_times))


def context_itls(llm: LLM, contexts: list[int], new_tokens: int) -> dict[str, float]:
    """The median inter-token latency (ms) of `new_tokens` decoded after a prompt of each length."""
    vocab = llm.engine.config.model_config.vocab_size
    return {f"itl_ms_at_{c}": 1000 * statistics.median(run_llmpipe(llm, random_prompt(vocab, c, seed=300 + c),
                                                                   new_tokens)["itl_s"]) for c in contexts}


def batch_throughput(llm: LLM, batch: int, new_tokens: int) -> float:
    """Output tokens/s of `batch` 16-token prompts decoded together (continuous batching)."""
    vocab = llm.engine.config.model_config.vocab_size
    prompts = [{"prompt_token_ids": random_prompt(vocab, 16, seed=200 + i)} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def bench_variant(args, variant: Variant, prompts: dict) -> dict:
    llm = LLM(args.model, progress=False, **variant.engine_options(args.group_size))
    result: dict = {"variant": variant.name, "weight_bytes": llm.engine.weight_bytes,
                    "kv_bytes_per_token": llm.engine.stats().kv_bytes_per_token}
    if variant.tensor_parallel_size > 1:  # the ranks share one memory bus: the roofline counts every shard
        ranks = llm.engine.rank_memory()
        result |= {"weight_bytes": sum(r.weight_bytes for r in ranks),
                   "weight_bytes_per_rank": [r.weight_bytes for r in ranks]}
    if variant.kv_cache:
        ttfts = ttft_samples(llm, len(prompts["long"]))
        result["ttft_s"] = min(ttfts)
    runs = {}
    for n in args.output_lens:
        if variant.kv_cache or n <= args.max_full_recompute:
            runs[n] = run_llmpipe(llm, prompts["short"], n)
            result[f"decode_{n}"] = runs[n]["decode_tokens_per_s"]
        else:
            result[f"decode_{n}"] = estimate_recompute_rate(llm, prompts["short"], n)
            result[f"decode_{n}_estimated"] = True
    if variant.kv_cache:
        result |= context_itls(llm, args.decode_contexts, min(args.output_lens))
    if args.batch_size and variant.kv_cache:
        result[f"batch_{args.batch_size}_tokens_per_s"] = batch_throughput(llm, args.batch_size, min(args.output_lens))
    if args.plot and variant.kv_cache:  # the samples the figure draws
        result |= {"ttft_samples_s": ttfts, "itl_samples_s": runs[max(args.output_lens)]["itl_s"]}
    llm.close()
    del llm
    gc.collect()
    return result


def bench_transformers(args, path: Path, prompts: dict) -> dict:
    from llmpipe.bench import hf_baseline

    model = hf_baseline.load_transformers_model(path, torch.float32)
    result: dict = {"variant": "transformers float32"}
    result["ttft_s"] = hf_baseline.best_ttft(model, prompts["long"], TTFT_TRIALS)
    for n in args.output_lens:
        result[f"decode_{n}"] = hf_baseline.measure(model, prompts["short"], n)["decode_tokens_per_s"]
    return result


VARIANTS = {
    "float32": Variant("float32"),
    "bfloat16": Variant("bfloat16", dtype="bfloat16"),
    "int8": Variant("int8", quantization="int8"),
    "int4": Variant("int4", quantization="int4"),
    # The GGUF's types kept as stored, with the default numerics (activation_quantization "auto").
    "gguf": Variant("gguf", dtype="auto", quantization="auto", activation_quantization="auto"),
    # Float activations, the exact reference: a GGUF block weight is dequantized at every step.
    "gguf float-act": Variant("gguf float-act", dtype="auto", quantization="auto"),
    "gguf int8-act": Variant("gguf int8-act", dtype="auto", quantization="auto", activation_quantization="int8"),
    "gguf int16-act": Variant("gguf int16-act", dtype="auto", quantization="auto", activation_quantization="int16"),
    "kv-int8": Variant("kv-int8", kv_cache_dtype="int8"),
    "gguf kv-int8": Variant("gguf kv-int8", dtype="auto", quantization="auto", kv_cache_dtype="int8"),
    "gguf int16-act kv-int8": Variant("gguf int16-act kv-int8", dtype="auto", quantization="auto",
                                      activation_quantization="int16", kv_cache_dtype="int8"),
    "kv-int4": Variant("kv-int4", kv_cache_dtype="int4"),
    "float32 no-kv-cache": Variant("float32 no-kv-cache", kv_cache=False),
}


def selected_variants(args) -> list[Variant]:
    """The named variants, plus one built from --quantization / --kv-cache-dtype when given."""
    variants = [VARIANTS[name] for name in args.variants]
    if args.quantization or args.kv_cache_dtype != "auto":
        name = f"{args.quantization or 'float32'} kv-{args.kv_cache_dtype}"
        variants.append(Variant(name, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype))
    tp = args.tensor_parallel_size
    if tp > 1:  # each right after its single-process twin, so the machine's drift hits both alike
        sharded = lambda v: [dataclasses.replace(v, name=f"{v.name} tp={tp}", tensor_parallel_size=tp)] if v.kv_cache else []  # noqa: E731
        variants = [w for v in variants for w in [v, *sharded(v)]]
    return variants


def run(args) -> dict:
    probe = LLM(args.model, progress=True, dtype="float32")  # float weights: the transformers roofline
    vocab = probe.engine.config.model_config.vocab_size
    path = probe.engine.checkpoint_path
    model_config = dataclasses.asdict(probe.engine.config.model_config)
    f32_bytes = probe.engine.weight_bytes
    del probe
    prompts = {"long": random_prompt(vocab, args.prompt_len), "short": random_prompt(vocab, 16)}
    bandwidth = roofline.memory_bandwidth()
    report = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "memory_bandwidth_GBps": bandwidth / 1e9,
        "matmul_GFLOPs": roofline.matmul_flops() / 1e9,
        "model_config": model_config,
        "decode_prompt_len": len(prompts["short"]),
        "prompt_len": args.prompt_len,
        "output_lens": args.output_lens,
        "decode_contexts": sorted(args.decode_contexts),
        "results": [],
    }
    variants = selected_variants(args) + ([] if args.no_baseline else ["transformers"])
    rounds = max(1, getattr(args, "rounds", 1))
    report["rounds"] = rounds
    steps = tqdm([(r, v) for r in range(rounds) for v in variants], desc="bench latency", unit="variant")
    per_round: list[list[dict]] = []
    for r, variant in steps:
        if variant == variants[0]:
            per_round.append([])
        steps.set_postfix_str(f"round {r + 1}: {getattr(variant, 'name', variant)}")
        per_round[-1].append(bench_transformers(args, path, prompts) if variant == "transformers"
                             else bench_variant(args, variant, prompts))
        if variant == variants[-1] and args.peer == "llama.cpp":  # each round ends with the peer, so drift hits all
            per_round[-1].append(bench_llama_cpp(args, Path(path), report["threads"]))
    report["results"] = merge_rounds(per_round, args.output_lens)
    add_ratios(report, f32_bytes)
    return report


def merge_rounds(per_round: list[list[dict]], output_lens: list[int]) -> list[dict]:
    """One result per variant from rounds of the same variants: decode rates the median over rounds,
    TTFT the best; with more than one round each result keeps its rounds' decode rates
    (`decode_N_rounds`) and, beside a peer, the ratio to it within each round."""
    merged = [dict(r) for r in per_round[0]]
    if len(per_round) == 1:
        return merged
    peer_at = next((i for i, r in enumerate(merged) if r.get("peer")), None)
    for i, result in enumerate(merged):
        column = [results[i] for results in per_round]
        if all(r.get("ttft_s") for r in column):
            result["ttft_s"] = min(r["ttft_s"] for r in column)
        for n in output_lens:
            key = f"decode_{n}"
            if all(r.get(key) for r in column):
                rates = [r[key] for r in column]
                result[key], result[f"{key}_rounds"] = statistics.median(rates), rates
                if peer_at is not None and i != peer_at:
                    result[f"{key}_vs_llama_cpp_rounds"] = [r[key] / results[peer_at][key] for r, results
                                                            in zip(column, per_round)]
        for key in [k for k in result if k.startswith("itl_ms_at_")]:
            result[key], result[f"{key}_rounds"] = statistics.median(r[key] for r in column), [r[key] for r in column]
    return merged


def bench_llama_cpp(args, path: Path, threads: int) -> dict:
    """llama-bench on the same file: pp`prompt_len` and tg`n` (from an empty context, as llama-bench
    runs it; ours decode after a 16-token prompt), its own repetitions' mean."""
    from llmpipe.bench import peers

    if path.suffix != ".gguf":
        raise peers.PeerUnavailableError(f"--peer llama.cpp needs a GGUF model; {path} is not one")
    result: dict = {"variant": f"llama.cpp (llama-bench -t {threads})", "peer": True, "weight_bytes": path.stat().st_size}
    for n in args.output_lens:
        rates = peers.llama_bench(path, threads, args.prompt_len, n)
        result[f"decode_{n}"] = rates[f"tg{n}"]
        result["ttft_s"] = args.prompt_len / rates[f"pp{args.prompt_len}"]
        result["llama_bench"] = rates
    for c in args.decode_contexts:  # tokens/s of min(output_lens) decoded after c tokens of context
        result[f"itl_ms_at_{c}"] = 1000 / peers.llama_bench_decode(path, threads, c, min(args.output_lens))
    return result


def add_ratios(report: dict, f32_bytes: int) -> None:
    baseline = next((r for r in report["results"] if r["variant"].startswith("transformers")), None)
    peer = next((r for r in report["results"] if r.get("peer")), None)
    bandwidth = report["memory_bandwidth_GBps"] * 1e9
    for r in report["results"]:
        roof = roofline.decode_roofline_tokens_per_s(r.get("weight_bytes", f32_bytes), bandwidth)
        r["roofline_tokens_per_s"] = roof
        for n in report["output_lens"]:
            rate = r.get(f"decode_{n}")
            if rate:
                r[f"decode_{n}_vs_roofline"] = rate / roof
                if baseline and baseline.get(f"decode_{n}"):
                    r[f"decode_{n}_vs_transformers"] = rate / baseline[f"decode_{n}"]
        if baseline and r.get("ttft_s") and baseline.get("ttft_s"):
            r["ttft_speedup_vs_transformers"] = baseline["ttft_s"] / r["ttft_s"]
        if peer:
            for n in report["output_lens"]:
                if r.get(f"decode_{n}") and peer.get(f"decode_{n}"):
                    r[f"decode_{n}_vs_llama_cpp"] = r[f"decode_{n}"] / peer[f"decode_{n}"]
            if r.get("ttft_s"):
                r["prefill_vs_llama_cpp"] = peer["ttft_s"] / r["ttft_s"]
    contexts = report.get("decode_contexts", [])
    for r in report["results"]:
        if len(contexts) > 1 and r.get(f"itl_ms_at_{contexts[0]}"):
            r["itl_longest_vs_shortest_context"] = r[f"itl_ms_at_{contexts[-1]}"] / r[f"itl_ms_at_{contexts[0]}"]
    cached = next((r for r in report["results"] if r["variant"] == "float32"), None)
    recompute = next((r for r in report["results"] if r["variant"] == "float32 no-kv-cache"), None)
    if cached and recompute:
        report["kv_cache_speedup"] = {
            n: cached[f"decode_{n}"] / recompute[f"decode_{n}"] for n in report["output_lens"]
        }
    if cached:
        rates = [f"decode_{n}" for n in report["output_lens"]] + [k for k in cached if k.startswith("batch_")]
        for r in report["results"]:
            for key in rates:
                if r.get(key) and cached.get(key) and not r["variant"].startswith("transformers"):
                    r[f"{key}_vs_float32"] = r[key] / cached[key]


def latency_table(report: dict) -> str:
    lens = report["output_lens"]
    batch_key = next((k for k in report["results"][0] if k.startswith("batch_") and k.endswith("_per_s")), None)
    peer = any(r.get("peer") for r in report["results"])
    header = ["variant", "weights MB", f"TTFT {report['prompt_len']} (ms)"] + (["prefill vs llama.cpp"] if peer else [])
    for n in lens:
        header += [f"decode@{n} tok/s", "vs f32", "vs HF", "of roofline"] + (["vs llama.cpp"] if peer else [])
    if batch_key:
        header += [f"batch-{batch_key.split('_')[1]} tok/s", "vs f32"]
    rows = [header]
    for r in report["results"]:
        ttft = r.get("ttft_s")
        weights = r.get("weight_bytes")
        row = [r["variant"], f"{weights / 1e6:.0f}" if weights else "-", f"{ttft * 1000:.0f}" if ttft else "-"]
        if peer:
            row.append(f"{r['prefill_vs_llama_cpp']:.2f}x" if "prefill_vs_llama_cpp" in r else "-")
        for n in lens:
            rate = r.get(f"decode_{n}")
            mark = "~" if r.get(f"decode_{n}_estimated") else ""
            row += [
                f"{mark}{rate:.1f}" if rate else "-",
                f"{r[f'decode_{n}_vs_float32']:.2f}x" if f"decode_{n}_vs_float32" in r else "-",
                f"{r[f'decode_{n}_vs_transformers']:.2f}x" if f"decode_{n}_vs_transformers" in r else "-",
                f"{r[f'decode_{n}_vs_roofline']:.0%}" if f"decode_{n}_vs_roofline" in r else "-",
            ] + ([f"{r[f'decode_{n}_vs_llama_cpp']:.2f}x" if f"decode_{n}_vs_llama_cpp" in r else "-"] if peer else [])
        if batch_key:
            rate, ratio = r.get(batch_key), r.get(f"{batch_key}_vs_float32")
            row += [f"{rate:.1f}" if rate else "-", f"{ratio:.2f}x" if ratio else "-"]
        rows.append(row)
    lines = [format_table(rows)]
    lines.append(f"memory bandwidth (streaming read, measured now): {report['memory_bandwidth_GBps']:.1f} GB/s")
    for r in report["results"]:
        if "weight_bytes_per_rank" in r:
            per_rank = " + ".join(f"{b / 1e6:.0f}" for b in r["weight_bytes_per_rank"])
            kv = r["kv_bytes_per_token"]
            lines.append(f"{r['variant']}: weights per rank {per_rank} MB, KV bytes per token on rank 0 {kv:,}")
    for n, ratio in report.get("kv_cache_speedup", {}).items():
        lines.append(f"KV cache vs recompute at {n} output tokens: {ratio:.1f}x")
    for r in report["results"]:
        for n in lens:
            if f"decode_{n}_vs_llama_cpp_rounds" in r:
                ratios = ", ".join(f"{x:.2f}x" for x in r[f"decode_{n}_vs_llama_cpp_rounds"])
                lines.append(f"{r['variant']}: decode@{n} vs llama.cpp by round: {ratios}")
    contexts = report.get("decode_contexts", [])
    for r in report["results"]:
        if contexts and r.get(f"itl_ms_at_{contexts[0]}"):
            itls = ", ".join(f"{r[f'itl_ms_at_{c}']:.2f} ms at {c}" for c in contexts)
            ratio = r.get("itl_longest_vs_shortest_context")
            lines.append(f"{r['variant']}: decode ITL {itls}" + (f" ({ratio:.2f}x)" if ratio else ""))
    if report.get("rounds", 1) > 1:
        lines.append(f"{report['rounds']} rounds: decode rates are medians, TTFT the best")
    lines.append("~ = estimated from timed recompute steps at evenly spaced lengths")
    return "\n".join(lines)


def main(args) -> None:
    report = run(args)
    print(latency_table(report))
    print(f"wrote {write_json(args.output, report)}")
    if args.plot:
        from llmpipe.bench import plots

        print(f"wrote {plots.save(plots.latency_figure(report), args.plot)}")
