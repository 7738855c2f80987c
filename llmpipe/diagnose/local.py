"""Probing a model in this process: a batch of random-token prompts through LLMEngine, timed per request."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from llmpipe.bench import roofline
from llmpipe.bench.report import random_prompt
from llmpipe.diagnose.report import Limits, Setup, TimeSplit, Workload
from llmpipe.llm import LLM
from llmpipe.outputs import RequestOutput
from llmpipe.quant.apply import activation_bits
from llmpipe.sampling_params import SamplingParams
from llmpipe.tokenizer import IncrementalDetokenizer


def measure_limits(dtype: torch.dtype = torch.float32, model: nn.Module | None = None) -> Limits:
    """Peak streaming-read bandwidth and matmul FLOP/s: float32, or the model's dtype, or the
    integer-dot panels its quantized layers run (activation quantization), whichever is fastest."""
    flops = roofline.matmul_flops(torch.float32)
    if dtype != torch.float32:
        flops = max(flops, roofline.matmul_flops(dtype))
    bits = activation_bits(model) if model is not None else None
    if bits is not None:
        flops = max(flops, roofline.integer_dot_flops(bits))
    return Limits(bandwidth=roofline.memory_bandwidth(), flops=flops)


def engine_setup(llm: LLM) -> Setup:
    engine, config = llm.engine, llm.engine.config
    stats = engine.stats()
    return Setup(
        config=config.model_config,
        dtype=config.dtype,
        weight_bytes=engine.weight_bytes,
        kv_bytes_per_token=stats.kv_bytes_per_token,
        kv_capacity_tokens=stats.num_blocks * config.block_size,
        kv_peak_usage=stats.peak_blocks_in_use / stats.num_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        prefix_caching=config.enable_prefix_caching,
        group_size=config.group_size,
    )


def run_probe(llm: LLM, prompt_len: int, output_len: int, batch: int = 1) -> tuple[Workload, TimeSplit]:
    """`batch` random prompts of prompt_len tokens at once, each generating exactly output_len tokens
    (after a short warm-up run, so first-touch costs stay out of the figures)."""
    vocab = llm.engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    warmup = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": random_prompt(vocab, min(prompt_len, 32), seed=-1)}], warmup, use_tqdm=False)
    prompts = [{"prompt_token_ids": random_prompt(vocab, prompt_len, seed=i)} for i in range(batch)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    workload = Workload(prompt_len, statistics.fmean(len(o.outputs[0].token_ids) for o in outputs), batch)
    return workload, time_split(outputs, detokenize_seconds(llm, outputs))


def detokenize_seconds(llm: LLM, outputs: list[RequestOutput]) -> float:
    """The engine detokenizes inside each step; replaying it times that share of the step."""
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        return 0.0
    start = time.perf_counter()
    for out in outputs:
        detok = IncrementalDetokenizer(tokenizer)
        for token in out.outputs[0].token_ids:
            detok.add(token)
        detok.finish()
    return time.perf_counter() - start


def time_split(outputs: list[RequestOutput], detokenize_s: float) -> TimeSplit:
    """Mean per-request split from each request's timing_breakdown(). A step detokenizes every running
    sequence, so a request's decode time holds the whole batch's detokenizing: that is the overhead."""
    rows = [o.metrics.timing_breakdown() for o in outputs]

    def mean(key: str) -> float:
        return statistics.fmean(r[key] or 0.0 for r in rows)

    gaps = [g for o in outputs for g in o.metrics.itl]
    metrics = [o.metrics for o in outputs]
    decode = mean("decode_s")
    overhead = min(detokenize_s, decode)
    return TimeSplit(
        queue_s=mean("queue_s"),
        prefill_s=mean("prefill_s"),
        decode_s=decode - overhead,
        overhead_s=overhead,
        mean_itl_s=statistics.fmean(gaps) if gaps else None,
        max_itl_s=max(gaps) if gaps else None,
        prefill_wall_s=max(m.first_token_time for m in metrics) - min(m.first_scheduled_time for m in metrics),
    )
