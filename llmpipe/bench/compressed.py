"""`llmpipe bench compressed`: DeepSeek V4's compressed attention against dense grouped-query attention.

Two random-weight checkpoints of about the same parameter count are built with transformers: a V4-style
model, scaled down but with the published attention shapes (a 128-token window of one shared K=V head,
CSA entries every 4 tokens with a lightning indexer keeping the top 512, HCA entries every 128, RoPE on
the last 64 of 128 dims with YaRN on the compressed layers, grouped low-rank output, MoE,
hyper-connections), and a Llama of the same width and depth (8 query heads, 2 KV heads of 64). For each
context, each model prefills one random prompt and decodes (bench/one_sequence.py): the KV bytes the
engine says the sequence holds, beside the planner's figure (diagnose/compressed_kv.py) for V4 and
2 × layers × KV heads × head_dim × tokens × bytes for the dense model, and the median decode step.
"""

from __future__ import annotations

import contextlib
import gc
import json
import tempfile
from functools import partial
from pathlib import Path

import torch

from llmpipe.bench import plots
from llmpipe.bench.one_sequence import measure
from llmpipe.bench.report import format_table, write_json
from llmpipe.config import DTYPES
from llmpipe.models.deepseek_v4.config import CSA, HCA, WINDOW
from llmpipe.diagnose.compressed_kv import plan_compressed_kv
from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.llm import LLM

VOCAB_SIZE = 32000
MODELS = {"v4": "V4-style", "dense": "dense GQA"}


def v4_schedule(num_layers: int) -> list[str]:
    """One window-only layer (V4-Flash opens with them), then HCA, then CSA / HCA alternating (V4-Pro's)."""
    return [WINDOW, HCA] + [CSA if i % 2 == 0 else HCA for i in range(num_layers - 2)]


def v4_config(transformers, hidden_size: int, num_layers: int, max_len: int):
    """V4-Flash's attention shapes at a small width: q / o low-rank dims hidden/4, experts hidden/2 wide."""
    original = -(-max_len // 16)
    return transformers.DeepseekV4Config(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, num_hidden_layers=num_layers, layer_types=v4_schedule(num_layers),
        num_attention_heads=8, num_key_value_heads=1, head_dim=128, partial_rotary_factor=0.5, sliding_window=128,
        q_lora_rank=hidden_size // 4, o_groups=4, o_lora_rank=hidden_size // 4,
        index_n_heads=8, index_head_dim=64, index_topk=512,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=hidden_size // 2,
        hc_mult=4, max_position_embeddings=16 * original,
        # YaRN on the compressed layers: factor 16 over a 16th of the context, as V4 publishes it
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": original},
    )


def dense_config(transformers, hidden_size: int, num_layers: int, max_len: int, target_params: int):
    """A Llama of the same width and depth whose MLP width brings it to about `target_params`."""
    def config(intermediate: int):
        return transformers.LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=intermediate, num_hidden_layers=num_layers,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=max_len,
            tie_word_embeddings=False,
        )
    probe = hidden_size
    per_unit = 3 * hidden_size * num_layers  # gate, up and down grow by this per unit of MLP width
    intermediate = probe + (target_params - parameter_count(transformers, config(probe))) / per_unit
    return config(max(16, 16 * round(intermediate / 16)))


def parameter_count(transformers, config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())


def save_random_checkpoint(transformers, config, out_dir: Path) -> int:
    """transformers' own random init (std 0.02, zero sinks and pooling biases); the hash-routed MoE layers
    get a random token → experts table (zeros at init would send every token to expert 0). Returns parameters."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, table in model.named_buffers():
        if name.endswith("tid2eid"):
            table.copy_(torch.rand(table.shape[0], config.n_routed_experts).argsort(dim=-1)[:, : table.shape[1]])
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def build_checkpoints(root: Path, hidden_size: int, num_layers: int, max_len: int) -> dict[str, dict]:
    try:
        import transformers
    except ImportError as e:
        raise LLMPipeError("bench compressed builds its checkpoints with transformers, a test dependency: "
                           "pip install -e '.[test]'") from e
    v4 = v4_config(transformers, hidden_size, num_layers, max_len)
    dense = dense_config(transformers, hidden_size, num_layers, max_len, parameter_count(transformers, v4))
    models = {}
    for name, config in (("v4", v4), ("dense", dense)):
        path = root / name
        models[name] = {"path": path, "params": save_random_checkpoint(transformers, config, path),
                        "config": json.loads((path / "config.json").read_text())}
    return models


def run_model(path: Path, args, max_len: int, kv_cache_memory: int) -> dict[int, dict]:
    llm = LLM(str(path), dtype=args.dtype, kv_cache_memory=kv_cache_memory, max_model_len=max_len,
              max_num_batched_tokens=args.max_num_batched_tokens)
    results = {context: measure(llm.engine, context, args.decode_tokens) for context in args.contexts}
    del llm
    gc.collect()
    return results


def dense_kv_bytes(cfg: dict, tokens: int, width: int) -> int:
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * tokens * width


def main(args) -> None:
    if args.num_layers < 3 or args.decode_tokens < 1 or min(args.contexts) < 1:
        raise InvalidRequestError("bench compressed needs --num-layers ≥ 3 (window, HCA, CSA), --decode-tokens ≥ 1 "
                                  "and positive --contexts")
    max_len = max(args.contexts) + args.decode_tokens + 1
    width = DTYPES[args.dtype].itemsize
    with contextlib.ExitStack() as stack:
        root = args.checkpoint_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="llmpipe-bench-"))
        models = build_checkpoints(Path(root), args.hidden_size, args.num_layers, max_len)
        # Both engines get room for the dense model's longest sequence, with slack, and at least 128 MiB:
        # each V4 window store holds a whole prefill chunk's rows while it runs.
        dense_need = dense_kv_bytes(models["dense"]["config"], max_len + max_len // 16, width)
        memory = args.kv_cache_memory or max(2**27, dense_need)
        results = {name: run_model(model["path"], args, max_len, memory) for name, model in models.items()}
    report = {
        "dtype": args.dtype, "threads": torch.get_num_threads(), "decode_tokens": args.decode_tokens,
        "kv_cache_memory": memory, "max_num_batched_tokens": args.max_num_batched_tokens,
        "models": {name: {"params": m["params"], "config": m["config"]} for name, m in models.items()},
        "contexts": {context: compare(models, results["v4"][context], results["dense"][context], args.dtype)
                     for context in args.contexts},
    }
    print(format_table(table(report)))
    print(f"parameters: {MODELS['v4']} {models['v4']['params']:,}, {MODELS['dense']} {models['dense']['params']:,}")
    print(f"wrote {write_json(args.output, report)}")
    print(f"wrote {plots.save(figure(report), args.plot)}")


def compare(models: dict, v4: dict, dense: dict, dtype: str) -> dict:
    """One context's measurements, each beside its prediction, and the V4 / dense ratios."""
    v4["planned_kv_bytes"] = plan_compressed_kv(models["v4"]["config"], "v4", dtype=dtype,
                                                context=v4["tokens"]).kv_bytes_per_sequence
    dense["analytic_kv_bytes"] = dense_kv_bytes(models["dense"]["config"], dense["tokens"], DTYPES[dtype].itemsize)
    return {"v4": v4, "dense": dense, "kv_ratio": v4["kv_bytes_per_seq"] / dense["kv_bytes_per_seq"],
            "itl_ratio": v4["decode_itl_ms"] / dense["decode_itl_ms"]}


def table(report: dict) -> list[list[str]]:
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    rows = [["context", "KV V4 (MiB)", "V4 planned", "KV dense (MiB)", "dense analytic", "KV V4/dense",
             "ITL V4 (ms)", "ITL dense (ms)", "ITL V4/dense", "prefill V4 (s)", "prefill dense (s)"]]
    for context, r in report["contexts"].items():
        v4, dense = r["v4"], r["dense"]
        rows.append([
            str(context), mib(v4["kv_bytes_per_seq"]), mib(v4["planned_kv_bytes"]), mib(dense["kv_bytes_per_seq"]),
            mib(dense["analytic_kv_bytes"]), f"{r['kv_ratio']:.3f}", f"{v4['decode_itl_ms']:.1f}",
            f"{dense['decode_itl_ms']:.1f}", f"{r['itl_ratio']:.2f}", f"{v4['prefill_s']:.1f}",
            f"{dense['prefill_s']:.1f}",
        ])
    return rows


def figure(report: dict):
    """KV MiB per sequence and decode ITL against context, both models."""
    contexts = [int(c) for c in report["contexts"]]

    def line(model: str, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
        return contexts, [r[model][key] * scale for r in report["contexts"].values()]

    kv = {f"{MODELS['v4']} measured": line("v4", "kv_bytes_per_seq", 2**-20),
          f"{MODELS['v4']} planned": line("v4", "planned_kv_bytes", 2**-20),
          f"{MODELS['dense']} measured": line("dense", "kv_bytes_per_seq", 2**-20),
          f"{MODELS['dense']} analytic": line("dense", "analytic_kv_bytes", 2**-20)}
    itl = {MODELS[m]: line(m, "decode_itl_ms") for m in MODELS}
    return plots.figure([
        partial(plots.draw_lines, series=kv, xlabel="context (tokens)", ylabel="KV cache per sequence (MiB)",
                title="KV bytes per sequence", styles=dict(zip(kv, ("C0o-", "C0x--", "C1o-", "C1x--")))),
        partial(plots.draw_lines, series=itl, xlabel="context (tokens)", ylabel="decode step (ms)",
                title=f"decode ITL (median of {report['decode_tokens']})"),
    ], title=f"llmpipe bench compressed ({report['dtype']}, {report['threads']} threads)")
