"""`llmpipe eval perplexity`: sliding-window perplexity of a text under any engine configuration."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmpipe.eval.perplexity import TEXT


def add_eval_parser(sub) -> None:
    from llmpipe.cli import add_engine_args

    evals = sub.add_parser("eval", help="measure model quality").add_subparsers(dest="eval", required=True)
    ppl = evals.add_parser("perplexity", help="sliding-window perplexity (Hugging Face's strided method)")
    add_engine_args(ppl)
    ppl.add_argument("--text", type=Path, default=TEXT, help="UTF-8 text file (default: Hamlet, shipped with llmpipe)")
    ppl.add_argument("--context", type=int, default=512, help="tokens per window")
    ppl.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    ppl.set_defaults(func=cmd_perplexity)


def cmd_perplexity(args: argparse.Namespace) -> None:
    from llmpipe.cli import engine_kwargs
    from llmpipe.config import EngineConfig
    from llmpipe.engine.engine import LLMEngine
    from llmpipe.errors import InvalidRequestError
    from llmpipe.eval.perplexity import perplexity

    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read {args.text}: {exc}") from exc
    engine = LLMEngine(EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args)))
    if engine.tokenizer is None:
        raise InvalidRequestError(f"{args.model} has no tokenizer to turn the text into tokens")
    ids = engine.tokenizer.encode(text)[: args.max_tokens]
    result = perplexity(engine, ids, args.context, args.stride)
    print(
        f"perplexity {result.perplexity:.4f} (mean NLL {result.nll:.5f} nats over {result.num_tokens} tokens, "
        f"{result.num_windows} windows, context {args.context}, stride {args.stride})"
    )
