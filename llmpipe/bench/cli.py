"""`llmpipe bench ...` sub-commands."""

from __future__ import annotations

import argparse
import os

from llmpipe.engine_args import add_engine_arg


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
        default=["float32", "bfloat16", "int8", "int4", "gguf", "float32 no-kv-cache"],
        help="any of: float32, bfloat16, int8, int4 (round-to-nearest at load), gguf (the GGUF's types kept as stored, "
             "default numerics), 'gguf int8-act' / 'gguf int16-act' (8- / 16-bit activation blocks: integer dot products), "
             "'gguf float-act' (float activations, the exact reference: block weights dequantized every step), "
             "kv-int8, kv-int4, 'gguf kv-int8', 'float32 no-kv-cache'",
    )
    latency.add_argument("--quantization", choices=["int8", "int4"], default=None, help="add a variant with these weights")
    latency.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128])
    latency.add_argument("--kv-cache-dtype", choices=["auto", "int8", "int4"], default="auto",
                         help="add a variant with this KV cache")
    latency.add_argument("--batch-size", type=int, default=32, help="also measure batched decode throughput (0: skip)")
    latency.add_argument("--tensor-parallel-size", type=int, default=1,
                         help="also run each variant sharded over N processes (the machine's threads shared out)")
    latency.add_argument("--speculative-method", nargs="+", choices=["ngram", "draft"], default=None,
                         help="instead: batch-1 decode with each method vs without, on input-grounded and open-ended prompts")
    latency.add_argument("--speculative-model", default=None, help="the draft (default: --model itself)")
    latency.add_argument("--speculative-quantization", default="int4", choices=["auto", "int8", "int4"],
                         help="the draft's weights (default int4: the float target's INT4 copy)")
    latency.add_argument("--num-speculative-tokens", type=int, default=4)
    latency.add_argument("--spec-output-len", type=int, default=128, help="tokens per prompt in the speculative run")
    latency.add_argument("--max-full-recompute", type=int, default=128, help="longer no-cache runs are estimated")
    latency.add_argument("--no-baseline", action="store_true", help="skip transformers")
    latency.add_argument("--peer", choices=["llama.cpp"], default=None,
                         help="also run llama.cpp's llama-bench on the same GGUF (built by `make bench-peers`)")
    latency.add_argument("--decode-contexts", type=int, nargs="+", default=[], metavar="TOKENS",
                         help="also time decode ITL after prompts of these lengths (e.g. 128 2048: is decode "
                              "cost flat with context?); the peer decodes at the same depths")
    latency.add_argument("--rounds", type=int, default=1,
                         help="run every variant (and the peer) this many times in turn: decode rates are the "
                              "medians, TTFT the best (a noisy machine's drift then hits every variant alike)")
    latency.add_argument("--output", default="bench_results/latency.json")
    latency.add_argument("--plot", metavar="FILE.png", help="also draw TTFT/ITL distributions and the roofline")
    latency.set_defaults(func=_run_latency)

    breakdown = kinds.add_parser(
        "breakdown", help="a batch-1 decode step's layers / LM head / rest, layer by layer vs the fused decode step")
    breakdown.add_argument("--model", default="smollm2-135m-instruct")
    breakdown.add_argument("--variants", nargs="+", default=["gguf", "gguf int8-act", "float32"],
                           help="as bench latency's --variants")
    breakdown.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128])
    breakdown.add_argument("--tokens", type=int, default=64, help="decode steps per run")
    breakdown.add_argument("--repeats", type=int, default=3, help="runs per path, alternating")
    breakdown.add_argument("--output", default="bench_results/breakdown.json")
    breakdown.set_defaults(func=_run_breakdown)

    tput = kinds.add_parser("throughput", help="continuous batching vs one at a time vs transformers")
    tput.add_argument("--model", default="smollm2-135m-instruct")
    tput.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                      help="auto: a GGUF's quantized weights kept as stored (float32 dequantizes them)")
    add_engine_arg(tput, "activation_quantization")
    tput.add_argument("--num-prompts", type=int, default=64)
    tput.add_argument("--input-len", type=int, default=128)
    tput.add_argument("--output-len", type=int, default=128)
    tput.add_argument("--max-num-seqs", type=int, default=128)
    add_engine_arg(tput, "max_num_batched_tokens")
    tput.add_argument("--sequential-prompts", type=int, default=4, help="how many prompts the one-at-a-time run measures")
    tput.add_argument("--prefix-len", type=int, default=0, help="also measure TTFT with/without a cached prefix")
    tput.add_argument("--no-baseline", action="store_true", help="skip transformers")
    tput.add_argument("--peer", choices=["llama.cpp"], help="also run llama-batched-bench on the same GGUF (make bench-peers)")
    tput.add_argument("--output", default="bench_results/throughput.json")
    tput.add_argument("--plot", metavar="FILE.png", help="also draw TTFT/ITL, throughput vs batch and the roofline")
    tput.set_defaults(func=_run_throughput)

    structured = kinds.add_parser("structured", help="throughput with a JSON schema on every request vs none")
    structured.add_argument("--model", default="smollm2-135m-instruct")
    structured.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    structured.add_argument("--batch-size", type=int, default=16, help="requests run together")
    structured.add_argument("--input-len", type=int, default=64)
    structured.add_argument("--output-len", type=int, default=128)
    structured.add_argument("--repeats", type=int, default=5, help="runs of each kind, alternating")
    structured.add_argument("--output", default="bench_results/structured.json")
    structured.set_defaults(func=_run_structured)

    serve = kinds.add_parser("serve", help="load-test an OpenAI-compatible server (Poisson arrivals, streamed)")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--num-prompts", type=int, nargs="+", default=[64], help="one count, or one per concurrency")
    serve.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    serve.add_argument("--max-concurrency", type=int, nargs="+", default=None, help="one run per value")
    serve.add_argument("--input-len", type=int, default=128)
    serve.add_argument("--output-len", type=int, default=64)
    serve.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    serve.add_argument("--wait-for-server", type=float, default=0.0, help="seconds to wait for the server to come up")
    serve.add_argument("--json", metavar="FILE.json", default=None)
    serve.add_argument("--plot", metavar="FILE.png", default=None, help="latency percentiles and throughput")
    serve.add_argument("--peer", choices=["llama.cpp"], default=None,
                       help="instead of --base-url: start `llmpipe serve --model MODEL` and then llama-server on the "
                            "same GGUF (built by `make bench-peers`), run the same load on each, print the ratios")
    serve.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="with --peer: threads of each server")
    serve.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                       help="with --peer: more `llmpipe serve` options (the rest of the command line)")
    serve.set_defaults(func=_run_serve)

    window = kinds.add_parser("window", help="KV bytes and decode ITL with sliding windows vs forced full attention")
    window.add_argument("--model", default="gemma3-270m")
    window.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    window.add_argument("--decode-tokens", type=int, default=16)
    window.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    window.add_argument("--kv-cache-memory", default="2GiB")
    add_engine_arg(window, "max_num_batched_tokens")
    window.add_argument("--output", default="bench_results/window.json")
    window.set_defaults(func=_run_window)

    compressed = kinds.add_parser(
        "compressed", help="KV bytes and decode ITL of a V4-style compressed-attention model vs a dense GQA one "
                           "(random weights, built with transformers: a test dependency)")
    compressed.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    compressed.add_argument("--decode-tokens", type=int, default=16)
    compressed.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    compressed.add_argument("--hidden-size", type=int, default=512)
    compressed.add_argument("--num-layers", type=int, default=6, help="window, HCA, then CSA / HCA alternating")
    compressed.add_argument("--kv-cache-memory", default=None, help="default: what the dense model's longest sequence needs")
    add_engine_arg(compressed, "max_num_batched_tokens")
    compressed.add_argument("--checkpoint-dir", default=None, help="keep the two checkpoints here (default: a temporary folder)")
    compressed.add_argument("--output", default="bench_results/compressed.json")
    compressed.add_argument("--plot", metavar="FILE.png", default="bench_results/compressed.png")
    compressed.set_defaults(func=_run_compressed)

    multiturn = kinds.add_parser(
        "multiturn", help="multi-turn chats (each turn resends the conversation): prefix-cache hit rate, TTFT; "
                          "--compare runs them on a second server too")
    multiturn.add_argument("--url", default="http://127.0.0.1:8000")
    multiturn.add_argument("--compare", metavar="URL2", default=None,
                           help="then the same chats against this server; prints hit rate (1)/(2), TTFT p50 (2)/(1)")
    multiturn.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    multiturn.add_argument("--api-key", default=None)
    multiturn.add_argument("--conversations", type=int, default=16)
    multiturn.add_argument("--turns", type=int, default=4)
    multiturn.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    multiturn.add_argument("--interleave", action="store_true",
                           help="every conversation open at once, --concurrency turns in flight; after each turn a "
                                "conversation comes back after a seeded random number of other turns (users reading "
                                "and typing), so the server holds every conversation's prefix between its turns")
    multiturn.add_argument("--max-tokens", type=int, default=16, help="tokens per assistant turn (ignore_eos)")
    multiturn.add_argument("--system-words", type=int, default=280,
                           help="words of each conversation's own system prompt (~300 tokens with SmolLM2's tokenizer)")
    multiturn.add_argument("--shared-words", type=int, default=0,
                           help="words of instructions every system prompt opens with (one application's chats)")
    multiturn.add_argument("--user-words", type=int, default=38, help="words per user turn (~40 tokens)")
    multiturn.add_argument("--seed", type=int, default=0)
    multiturn.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    multiturn.add_argument("--wait-for-server", type=float, default=0.0, help="seconds to wait for each server")
    multiturn.add_argument("--out", default="bench_results/multiturn.json")
    multiturn.set_defaults(func=_run_multiturn)

    robust = kinds.add_parser(
        "robustness", help="huge and hostile requests beside a live stream: answer, /health latency, stream gaps")
    robust.add_argument("--base-url", default="http://127.0.0.1:8000")
    robust.add_argument("--model", default=None, help="model id to request (default: the server's own)")
    robust.add_argument("--api-key", default=None)
    robust.add_argument("--output", default="bench_results/robustness.json")
    robust.add_argument("--probes", nargs="+", default=None, metavar="NAME", help="run only these probes (by name)")
    robust.add_argument("--no-stalled", dest="stalled", action="store_false", help="skip the stalled-headers probe")
    robust.set_defaults(func=_run_robustness)

    embed = kinds.add_parser(
        "embeddings", help="a stream's inter-token latency alone and beside clients sending embedding requests")
    embed.add_argument("--base-url", default="http://127.0.0.1:8000")
    embed.add_argument("--model", default=None, help="model id to request (default: the server's own)")
    embed.add_argument("--clients", type=int, default=16, help="embedding clients, each one request at a time")
    embed.add_argument("--words", type=int, default=100, help="words of each embedded document")
    embed.add_argument("--max-tokens", type=int, default=128, help="tokens of each streamed completion")
    embed.add_argument("--rounds", type=int, default=3, help="alone / beside pairs, alternated")
    embed.add_argument("--alone-seconds", type=float, default=20.0, help="the embeddings' window with no stream")
    embed.add_argument("--output", default="bench_results/embeddings.json")
    embed.set_defaults(func=_run_embed_stall)

    lora = kinds.add_parser("lora", help="a decode step mixing several LoRA adapters against a base-only one, at one batch")
    lora.add_argument("--model", default="smollm2-135m-instruct")
    lora.add_argument("--batch", type=int, default=16, help="requests decoding together")
    lora.add_argument("--adapters", type=int, default=4, help="random adapters the mixed batch spreads over")
    lora.add_argument("--rank", type=int, default=16, help="their rank (all seven linear projections)")
    lora.add_argument("--base-rows", type=int, default=0, help="requests of the mixed batch left on the base model")
    lora.add_argument("--prompt-len", type=int, default=64)
    lora.add_argument("--output-len", type=int, default=64, help="tokens each request decodes (ignore_eos)")
    lora.add_argument("--rounds", type=int, default=3, help="base / mixed pairs, alternated")
    add_engine_arg(lora, "dtype")
    add_engine_arg(lora, "quantization")
    add_engine_arg(lora, "num_threads")
    lora.add_argument("--output", default="bench_results/lora.json")
    lora.set_defaults(func=_run_lora)

    offload = kinds.add_parser(
        "offload", help="TTFT of a long prompt the KV pool evicted: restored from the host-memory and disk tiers "
                        "(after a restart) against computing it")
    offload.add_argument("--model", default="smollm2-135m-instruct")
    offload.add_argument("--prompt-tokens", type=int, default=4000)
    offload.add_argument("--rounds", type=int, default=3, help="prompts, each computed, evicted and restored")
    offload.add_argument("--kv-offload-memory", default="4GiB")
    offload.add_argument("--kv-offload-dir", default=None, help="the disk tier's folder (default: a temporary one)")
    offload.add_argument("--output", default="bench_results/kv_offload.json")
    offload.set_defaults(func=_run_offload)

    peers = kinds.add_parser("peers", help="build llama.cpp's llama-bench / llama-batched-bench / llama-server once")
    peers.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    peers.set_defaults(func=_run_peers)

    realsize = kinds.add_parser(
        "realsize", help="llmpipe vs llama.cpp on random-weight GGUFs at real model shapes (Llama 3.x 1B-8B, "
                         "Qwen2.5-7B): load, peak RSS, decode, prefill, a batch; builds llama.cpp and the GGUFs once")
    from llmpipe.bench.realsize import add_arguments as add_realsize_arguments  # no torch: the parser stays light

    add_realsize_arguments(realsize)
    realsize.set_defaults(func=_run_realsize)


def _run_latency(args) -> None:
    if args.speculative_method:
        from llmpipe.bench import speculative

        return speculative.main(args)
    from llmpipe.bench import latency

    latency.main(args)


def _run_breakdown(args) -> None:
    from llmpipe.bench import breakdown

    breakdown.main(args)


def _run_throughput(args) -> None:
    from llmpipe.bench import throughput

    throughput.main(args)


def _run_structured(args) -> None:
    from llmpipe.bench import structured

    structured.main(args)


def _run_serve(args) -> None:
    if args.peer:
        from llmpipe.bench import serve_peer

        if args.model is None:
            args.model = "smollm2-135m-instruct"
        serve_peer.main(args)
        return
    from llmpipe.bench import serve

    serve.main(args)


def _run_multiturn(args) -> None:
    from llmpipe.bench import multiturn

    multiturn.main(args)


def _run_lora(args) -> None:
    from llmpipe.bench.lora import run_lora_bench

    run_lora_bench(args.model, args.batch, args.adapters, args.rank, args.base_rows, args.prompt_len, args.output_len,
                   args.rounds, args.output, {"dtype": args.dtype, "quantization": args.quantization,
                                               "num_threads": args.num_threads})


def _run_embed_stall(args) -> None:
    from llmpipe.bench.embed_stall import run_embed_stall

    run_embed_stall(args.base_url, args.model, args.clients, args.words, args.max_tokens, args.rounds, args.output,
                    args.alone_seconds)


def _run_offload(args) -> None:
    from llmpipe.bench.kv_offload import run_offload_bench

    run_offload_bench(args.model, args.prompt_tokens, args.rounds, args.output, args.kv_offload_memory,
                      args.kv_offload_dir)


def _run_robustness(args) -> None:
    from llmpipe.bench.robustness import run_robustness

    from llmpipe.bench.robustness import PROBES

    unknown = sorted(set(args.probes or ()) - set(PROBES))
    if unknown:
        raise SystemExit(f"llmpipe: error: unknown probe {unknown[0]!r}; probes: {', '.join(PROBES)}")
    run_robustness(args.base_url, args.api_key, args.model, args.output, args.probes, args.stalled)


def _run_window(args) -> None:
    from llmpipe.bench import window

    window.main(args)


def _run_compressed(args) -> None:
    from llmpipe.bench import compressed

    compressed.main(args)


def _run_peers(args) -> None:
    from llmpipe.bench import peers

    print(f"llama.cpp peers in {peers.build(jobs=args.jobs)}")


def _run_realsize(args) -> None:
    from llmpipe.bench import realsize

    realsize.main(args)
