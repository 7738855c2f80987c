"""`llmpipe bench ...` sub-commands."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print ratios against a baseline measured in the same run")
    kinds = bench.add_subparsers(dest="bench", required=True)

    latency = kinds.add_parser("latency", help="TTFT and batch-1 decode vs transformers and the roofline")
    latency.add_argument("--model", default="smollm2-135m-instruct")
    latency.add_argument("--prompt-len", type=int, default=512)
    latency.add_argument("--output-lens", type=int, nargs="+", default=[128, 1000])
    latency.add_argument(
        "--variants",
        nargs="+",
        default=["float32", "bfloat16", "float32 no-kv-cache"],
    )
    latency.add_argument("--max-full-recompute", type=int, default=128, help="longer no-cache runs are estimated")
    latency.add_argument("--no-baseline", action="store_true", help="skip transformers")
    latency.add_argument("--output", default="bench_results/latency.json")
    latency.set_defaults(func=_run_latency)

    tput = kinds.add_parser("throughput", help="continuous batching vs one at a time vs transformers")
    tput.add_argument("--model", default="smollm2-135m-instruct")
    tput.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    tput.add_argument("--num-prompts", type=int, default=64)
    tput.add_argument("--input-len", type=int, default=128)
    tput.add_argument("--output-len", type=int, default=128)
    tput.add_argument("--max-num-seqs", type=int, default=128)
    tput.add_argument("--max-num-batched-tokens", type=int, default=2048)
    tput.add_argument("--sequential-prompts", type=int, default=4, help="how many prompts the one-at-a-time run measures")
    tput.add_argument("--prefix-len", type=int, default=0, help="also measure TTFT with/without a cached prefix")
    tput.add_argument("--no-baseline", action="store_true", help="skip transformers")
    tput.add_argument("--output", default="bench_results/throughput.json")
    tput.set_defaults(func=_run_throughput)


def _run_latency(args) -> None:
    from llmpipe.bench import latency

    latency.main(args)


def _run_throughput(args) -> None:
    from llmpipe.bench import throughput

    throughput.main(args)
