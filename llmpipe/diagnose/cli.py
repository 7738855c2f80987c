"""`llmpipe diagnose` (is the start slow or the streaming slow?) and `llmpipe memory` (will it fit?)."""

from __future__ import annotations

import argparse
import dataclasses

from llmpipe.config import DTYPES, INT4_GROUP_SIZES, KV_CACHE_DTYPES, parse_bytes
from llmpipe.diagnose.analysis import diagnose
from llmpipe.diagnose.report import Diagnosis, Setup
from llmpipe.diagnose.compressed_kv import NAMED_CONFIGS, plan_compressed_kv, read_config
from llmpipe.diagnose.memory import NAMED_ARCHITECTURES, plan_memory
from llmpipe.engine.step_size import default_step_tokens
from llmpipe.errors import InvalidRequestError, ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_diagnose_parser(sub) -> None:
    from llmpipe.engine_args import add_engine_args

    p = sub.add_parser("diagnose", help="time split, rates vs this machine's limits, verdict and levers")
    add_engine_args(p)
    p.set_defaults(model=None, func=cmd_diagnose)
    p.add_argument("--base-url", help="probe a running OpenAI-compatible server (e.g. http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="requests at once")
    p.add_argument("--output", default="bench_results/diagnose.json")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the time split and the roofline")


def add_memory_parser(sub) -> None:
    p = sub.add_parser("memory", help="will it fit, and how many sequences: weights and KV cache from the config")
    p.add_argument("--model", help="alias, Hugging Face directory, .gguf or config .json (only its config is read)")
    p.add_argument("--arch", choices=sorted(NAMED_ARCHITECTURES) + sorted(NAMED_CONFIGS),
                   help="a published architecture instead of --model (deepseek-*: KV cache only)")
    p.add_argument("--params", type=float, help="parameter count, e.g. 7e9 (the architecture's mix, rescaled)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="auto: as the engine loads it (a GGUF's quantized tensors as the file stores them); "
                        "none: every weight in --dtype")
    p.add_argument("--group-size", type=int, default=128, choices=INT4_GROUP_SIZES)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's limit)")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences")
    p.add_argument("--memory", default=None, help="memory for weights + KV, e.g. 24GiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens one step computes at most (its activations count in the process's peak; default: the "
                   "engine's for the model)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")
    p.set_defaults(func=cmd_memory)


def cmd_diagnose(args: argparse.Namespace) -> None:
    from llmpipe.bench.report import write_json
    from llmpipe.diagnose.render import format_diagnosis

    for name in ("prompt_len", "output_len", "batch"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    d, model = _diagnose_remote(args) if args.base_url else _diagnose_local(args)
    print(format_diagnosis(d, model))
    print(f"wrote {write_json(args.output, {'model': model, **dataclasses.asdict(d)})}")
    if args.plot:
        from llmpipe.bench.plots import save
        from llmpipe.diagnose.render import diagnosis_figure

        print(f"wrote {save(diagnosis_figure(d, model), args.plot)}")


def _diagnose_local(args: argparse.Namespace) -> tuple[Diagnosis, str]:
    from llmpipe.engine_args import engine_kwargs
    from llmpipe.diagnose.local import engine_setup, measure_limits, run_probe
    from llmpipe.llm import LLM

    model = args.model or DEFAULT_MODEL
    llm = LLM(model, **engine_kwargs(args))
    workload, split = run_probe(llm, args.prompt_len, args.output_len, args.batch)
    limits = measure_limits(llm.engine.config.torch_dtype, llm.engine.model)
    return diagnose(workload, split, engine_setup(llm), limits), model


def _diagnose_remote(args: argparse.Namespace) -> tuple[Diagnosis, str]:
    from llmpipe.diagnose.local import measure_limits
    from llmpipe.diagnose.remote import RemoteServer, run_remote_probe

    with RemoteServer(args.base_url, args.api_key) as server:
        model = args.model or server.first_model()
        workload, split = run_remote_probe(server, model, args.prompt_len, args.output_len, args.batch)
    setup = _planned_setup(model, args)
    d = diagnose(workload, split, setup, measure_limits(DTYPES[args.dtype]) if setup else None)
    if setup:
        d.notes.append(f"bytes and limits assume the server runs {model} in {args.dtype} on this machine")
    return d, f"{model} at {args.base_url}"


def _planned_setup(model: str, args: argparse.Namespace) -> Setup | None:
    """The model's costs from its config, when the served name is also a checkpoint readable here."""
    from llmpipe.loader import load_checkpoint

    try:
        cfg = load_checkpoint(model).config
    except ModelLoadError:
        return None
    quantization = getattr(args, "quantization", None)
    plan = plan_memory(cfg, model, dtype=args.dtype, quantization=quantization if quantization in ("int8", "int4")
                       else None, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    return Setup(cfg, args.dtype, plan.weights.resident, plan.kv_bytes_per_token,
                 max_num_batched_tokens=default_step_tokens(cfg))


def cmd_memory(args: argparse.Namespace) -> None:
    from llmpipe.bench.report import write_json
    from llmpipe.diagnose.render import format_plan

    if args.model and args.arch:
        raise InvalidRequestError("give --model or --arch, not both")
    if not (args.model or args.arch or args.params):
        raise InvalidRequestError("give --model, --arch or --params")
    for name in ("context", "batch", "block_size", "params"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be positive")
    compressed = read_config(args.arch or args.model) if args.arch in NAMED_CONFIGS or args.model else None
    if compressed:
        return _memory_compressed(args, *compressed)
    stored = None
    if args.model:
        from llmpipe.loader import load_checkpoint

        checkpoint = load_checkpoint(args.model)
        cfg, name, arch_note = checkpoint.config, args.model, ""
        stored = getattr(checkpoint.source, "stored_bytes", None)
    else:
        arch = args.arch or "llama-7b"
        cfg, name = NAMED_ARCHITECTURES[arch], f"{int(args.params):,} parameters" if args.params else arch
        arch_note = f" (tensor mix of {arch})" if args.params else ""
    plan = plan_memory(
        cfg, name, dtype=args.dtype, quantization=None if args.quantization == "none" else args.quantization,
        group_size=args.group_size, kv_cache_dtype=args.kv_cache_dtype, context=args.context, batch=args.batch,
        memory=parse_bytes(args.memory, "--memory") if args.memory else None, block_size=args.block_size,
        params=int(args.params) if args.params else None, stored=stored,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    print(format_plan(plan, arch_note))
    if args.json:
        print(f"wrote {write_json(args.json, {**dataclasses.asdict(plan), 'fits': plan.fits})}")


def _memory_compressed(args: argparse.Namespace, cfg: dict, name: str) -> None:
    """DeepSeek V4 / MLA configs: KV cache per layer kind (their weights are not planned)."""
    from llmpipe.bench.report import write_json
    from llmpipe.diagnose.render import format_compressed_plan

    dropped = [flag for flag, given in (("--params", args.params), ("--memory", args.memory),
                                        ("--quantization", args.quantization not in ("none", "auto")),
                                        ("--kv-cache-dtype", args.kv_cache_dtype != "auto")) if given]
    if dropped:
        raise InvalidRequestError(f"{name}: only the KV cache is planned for compressed attention; "
                                  f"drop {', '.join(dropped)}")
    plan = plan_compressed_kv(cfg, name, dtype=args.dtype, context=args.context, batch=args.batch)
    print(format_compressed_plan(plan))
    if args.json:
        report = {**dataclasses.asdict(plan), "kv_bytes_per_token": plan.kv_bytes_per_token,
                  "kv_bytes_per_sequence": plan.kv_bytes_per_sequence, "total_bytes": plan.total_bytes}
        print(f"wrote {write_json(args.json, report)}")
