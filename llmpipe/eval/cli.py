"""`llmpipe eval perplexity`: sliding-window perplexity of a text under any engine configuration.
`llmpipe eval agreement`: how closely a configuration's logits and greedy tokens follow the same
configuration with float (exact) activations."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmpipe.eval.perplexity import TEXT

QUANTIZED_PREFILL = ("score with quantized activations at every position (prefill normally takes the float GEMM): "
                     "the decode kernels' numerics")


def add_eval_parser(sub) -> None:
    from llmpipe.engine_args import add_engine_args

    evals = sub.add_parser("eval", help="measure model quality").add_subparsers(dest="eval", required=True)
    ppl = evals.add_parser("perplexity", help="sliding-window perplexity (Hugging Face's strided method)")
    add_engine_args(ppl)
    ppl.add_argument("--text", type=Path, default=TEXT, help="UTF-8 text file (default: Hamlet, shipped with llmpipe)")
    ppl.add_argument("--context", type=int, default=512, help="tokens per window")
    ppl.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    ppl.add_argument("--quantized-prefill", action="store_true", help=QUANTIZED_PREFILL)
    ppl.set_defaults(func=cmd_perplexity)
    agree = evals.add_parser("agreement", help="logits and greedy tokens against float (exact) activations")
    add_engine_args(agree)
    agree.add_argument("--text", type=Path, default=TEXT, help="UTF-8 text file (default: Hamlet, shipped with llmpipe)")
    agree.add_argument("--context", type=int, default=512, help="tokens per scored window")
    agree.add_argument("--windows", type=int, default=4, help="windows of the text to score")
    agree.add_argument("--prompts", type=int, default=8, help="greedy prompts (cut from the text, 64 tokens each)")
    agree.add_argument("--max-new-tokens", type=int, default=64)
    agree.add_argument("--output", type=Path, default=None, help="write the result as JSON here")
    agree.add_argument("--quantized-prefill", action="store_true", help=QUANTIZED_PREFILL)
    agree.set_defaults(func=cmd_agreement)


def _engine_and_text(args: argparse.Namespace, reference: bool = False):
    """The engine the flags describe (the reference: with float activations) and the text's token ids."""
    from llmpipe.engine_args import engine_kwargs
    from llmpipe.config import EngineConfig
    from llmpipe.engine.engine import LLMEngine
    from llmpipe.errors import InvalidRequestError

    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read {args.text}: {exc}") from exc
    from llmpipe.quant.apply import quantize_prefill

    options = engine_kwargs(args) | ({"activation_quantization": None} if reference else {})
    engine = LLMEngine(EngineConfig.from_kwargs(model=args.model, **options))
    if args.quantized_prefill and not reference and not quantize_prefill(engine.model):
        raise InvalidRequestError("--quantized-prefill needs --activation-quantization on a quantized model")
    if engine.tokenizer is None:
        raise InvalidRequestError(f"{args.model} has no tokenizer to turn the text into tokens")
    return engine, engine.tokenizer.encode(text)


def cmd_perplexity(args: argparse.Namespace) -> None:
    from llmpipe.eval.perplexity import perplexity

    engine, ids = _engine_and_text(args)
    ids = ids[: args.max_tokens]
    result = perplexity(engine, ids, args.context, args.stride)
    print(
        f"perplexity {result.perplexity:.4f} (mean NLL {result.nll:.5f} nats over {result.num_tokens} tokens, "
        f"{result.num_windows} windows, context {args.context}, stride {args.stride})"
    )


def cmd_agreement(args: argparse.Namespace) -> None:
    from llmpipe.eval.agreement import AgreementResult, greedy_divergences, logit_agreement

    candidate, ids = _engine_and_text(args)
    reference, _ = _engine_and_text(args, reference=True)
    correlation, top1, worst, positions = logit_agreement(candidate, reference, ids, args.context, args.windows)
    prompts = [ids[i * 64 : (i + 1) * 64] for i in range(args.prompts)]
    result = AgreementResult(correlation, top1, worst, positions,
                             greedy_divergences(candidate, reference, prompts, args.max_new_tokens))
    diverged = [d for d in result.divergences if d.step is not None]
    print(f"logit correlation {correlation:.6f}, same top token at {top1:.2%} of {positions} positions, "
          f"max |logit difference| {worst:.4f}")
    print(f"greedy: {len(result.divergences) - len(diverged)} of {len(result.divergences)} prompts identical for "
          f"{args.max_new_tokens} tokens" + "".join(f"; prompt {d.prompt} at step {d.step} (reference top-2 margin "
                                                    f"{d.reference_margin:.3f})" for d in diverged))
    print("meets the bar (correlation >= 0.998, divergences only at margins < 0.2):", result.meets())
    if args.output:
        args.output.write_text(json.dumps(result.to_dict(), indent=2))
