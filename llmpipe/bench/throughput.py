"""`llmpipe bench throughput`: continuous batching vs one request at a time vs transformers' batched
generate() (and, with `--peer llama.cpp`, llama-batched-bench on the same GGUF), all on the same
workload in one run; and TTFT with and without a cached prefix."""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

import torch

from llmpipe.bench.report import format_table, random_prompt, write_json
from llmpipe.llm import LLM
from llmpipe.outputs import RequestOutput
from llmpipe.sampling_params import SamplingParams


def _rates(num_prompts: int, input_len: int, output_len: int, seconds: float) -> dict:
    return {
        "seconds": seconds,
        "requests_per_s": num_prompts / seconds,
        "output_tokens_per_s": num_prompts * output_len / seconds,
        "total_tokens_per_s": num_prompts * (input_len + output_len) / seconds,
    }


def run_batched(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, dict, list[RequestOutput]]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start, _peak_stats(llm), outputs


def _peak_stats(llm: LLM) -> dict:
    stats = llm.engine.stats()
    return {"kv_bytes_per_token": stats.kv_bytes_per_token, "num_blocks": stats.num_blocks,
            "peak_blocks_in_use": stats.peak_blocks_in_use, "num_preemptions": stats.num_preemptions}


def run_one_at_a_time(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        llm.generate([{"prompt_token_ids": p}], params)
    return time.perf_counter() - start


def run_transformers(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    from llmpipe.bench import hf_baseline

    model = hf_baseline.load_transformers_model(llm.engine.checkpoint_path, torch.float32)
    seconds = hf_baseline.time_generate(model, torch.tensor(prompts), output_len)
    del model
    gc.collect()
    return seconds


def prefix_ttft(args, vocab: int) -> dict:
    """TTFT of a request whose first prefix_len tokens another request already computed, with the
    prefix cache on and off."""
    prefix = random_prompt(vocab, args.prefix_len, seed=10)
    warm = {"prompt_token_ids": prefix + random_prompt(vocab, 16, seed=11)}
    probe = {"prompt_token_ids": prefix + random_prompt(vocab, 16, seed=12)}
    params = SamplingParams(temperature=0.0, max_tokens=1)
    result = {}
    for enabled in (False, True):
        llm = LLM(args.model, progress=False, enable_prefix_caching=enabled, dtype=args.dtype)
        llm.generate([warm], params)
        result["cached" if enabled else "uncached"] = llm.generate([probe], params)[0].metrics.ttft
    result["speedup"] = result["uncached"] / result["cached"]
    return result


def plot_inputs(args, llm: LLM, outputs: list[RequestOutput]) -> dict:
    """What the figure draws beyond the table: the batched requests' timings, the model, this machine's limits."""
    from llmpipe.diagnose.local import measure_limits, time_split

    split, limits = time_split(outputs, 0.0), measure_limits(llm.engine.config.torch_dtype, llm.engine.model)
    samples = {"ttft_samples_s": [out.metrics.ttft for out in outputs],
               "itl_samples_s": [gap for out in outputs for gap in out.metrics.itl],
               "mean_itl_s": split.mean_itl_s, "prefill_wall_s": split.prefill_wall_s}
    return {
        "model_config": dataclasses.asdict(llm.engine.config.model_config), "weight_bytes": llm.engine.weight_bytes,
        "peak_batch": min(args.num_prompts, args.max_num_seqs),
        "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
        "memory_bandwidth_GBps": limits.bandwidth / 1e9, "matmul_GFLOPs": limits.flops / 1e9, "samples": samples}


def run(args) -> dict:
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              activation_quantization=args.activation_quantization)
    vocab = llm.engine.config.model_config.vocab_size
    prompts = [random_prompt(vocab, args.input_len, seed=i) for i in range(args.num_prompts)]
    n, i, o = args.num_prompts, args.input_len, args.output_len
    report: dict = {"model": args.model, "dtype": args.dtype, "num_prompts": n, "input_len": i, "output_len": o,
                    "prefix_len": args.prefix_len}
    seconds, stats, outputs = run_batched(llm, prompts, o)
    report["batched"] = {**_rates(n, i, o, seconds), **stats}
    if args.plot:
        report |= plot_inputs(args, llm, outputs)
    sequential = prompts[: args.sequential_prompts]
    report["one_at_a_time"] = _rates(len(sequential), i, o, run_one_at_a_time(llm, sequential, o))
    report["one_at_a_time"]["num_prompts_measured"] = len(sequential)
    if not args.no_baseline:
        report["transformers_batched"] = _rates(n, i, o, run_transformers(llm, prompts, o))
    if args.peer == "llama.cpp":
        report["llama_cpp_batched"] = run_llama_cpp(llm, n, i, o)
    del llm
    gc.collect()
    if args.prefix_len:
        report["prefix_ttft"] = prefix_ttft(args, vocab)
    base = report["batched"]["output_tokens_per_s"]
    report["speedup_vs_one_at_a_time"] = base / report["one_at_a_time"]["output_tokens_per_s"]
    for key in ("transformers_batched", "llama_cpp_batched"):
        if key in report:
            report[f"speedup_vs_{key.removesuffix('_batched')}"] = base / report[key]["output_tokens_per_s"]
    return report


def run_llama_cpp(llm: LLM, num_prompts: int, input_len: int, output_len: int) -> dict:
    """llama-batched-bench on the GGUF this engine loaded, with the engine's thread count."""
    from llmpipe.bench import peers

    path = Path(llm.engine.checkpoint_path)
    if path.suffix != ".gguf":
        raise peers.PeerUnavailableError(f"--peer llama.cpp needs a GGUF model; {path} is not one")
    threads = torch.get_num_threads()
    result = peers.llama_batched_bench(path, threads, num_prompts, input_len, output_len)
    return {**_rates(num_prompts, input_len, output_len, result["seconds"]), "llama_batched_bench": result,
            "threads": threads}


def throughput_table(report: dict) -> str:
    rows = [["run", "requests/s", "output tok/s", "total tok/s", "vs llmpipe batched"]]
    base = report["batched"]["output_tokens_per_s"]
    for key, label in [("batched", "llmpipe continuous batching"), ("one_at_a_time", "llmpipe one at a time"),
                       ("transformers_batched", "transformers generate (batched)"),
                       ("llama_cpp_batched", "llama.cpp llama-batched-bench")]:
        if key in report:
            r = report[key]
            rows.append([label, f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                         f"{r['total_tokens_per_s']:.1f}", f"{r['output_tokens_per_s'] / base:.2f}x"])
    lines = [format_table(rows)]
    lines.append(f"batched vs one at a time: {report['speedup_vs_one_at_a_time']:.1f}x")
    for key, label in (("speedup_vs_transformers", "transformers"), ("speedup_vs_llama_cpp", "llama.cpp")):
        if key in report:
            lines.append(f"batched vs {label}: {report[key]:.2f}x")
    b = report["batched"]
    lines.append(f"KV bytes per token: {b['kv_bytes_per_token']:,}; blocks in use at peak: "
                 f"{b['peak_blocks_in_use']} of {b['num_blocks']}; preemptions: {b['num_preemptions']}")
    if "prefix_ttft" in report:
        p = report["prefix_ttft"]
        lines.append(f"TTFT with a cached {report['prefix_len']}-token prefix: {p['cached'] * 1000:.0f} ms vs "
                     f"{p['uncached'] * 1000:.0f} ms uncached ({p['speedup']:.1f}x)")
    return "\n".join(lines)


def main(args) -> None:
    report = run(args)
    print(throughput_table(report))
    print(f"wrote {write_json(args.output, report)}")
    if args.plot:
        from llmpipe.bench import plots

        print(f"wrote {plots.save(plots.throughput_figure(report), args.plot)}")
