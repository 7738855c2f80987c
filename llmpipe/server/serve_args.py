"""`llmpipe serve`'s options, defined once: the command line parses them, and the Ray deployment
(`llmpipe/deploy/ray.py`) reads its application's args as them."""

from __future__ import annotations

import argparse

from llmpipe.engine_args import add_engine_args
from llmpipe.server.http import BODY_TIMEOUT_S, HEADER_TIMEOUT_S
from llmpipe.tool_parsers import TOOL_PARSERS


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """Every `llmpipe serve` option: the server's, then the engine's (serve's own default: streams first)."""
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on every route but /health "
                       "and / (docs included)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    serve.add_argument("--max-waiting", type=int, default=512, help="queued requests before new ones get 503")
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM (meanwhile /health and new requests get 503)",
    )
    serve.add_argument(
        "--header-timeout", type=float, default=HEADER_TIMEOUT_S, help="seconds a client has to send a request's headers"
    )
    serve.add_argument(
        "--body-timeout", type=float, default=BODY_TIMEOUT_S, help="seconds a client has to send a request's body (else 408)"
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls (default: recognised from its chat template)",
    )
    serve.add_argument(
        "--data-parallel-size", type=_positive, default=1,
        help="engine replicas (each its own core and KV cache) on Ray Serve behind this one endpoint (needs llmpipe[ray])",
    )
    serve.add_argument(
        "--routing", default="prefix", choices=["prefix", "round_robin"],
        help="with --data-parallel-size > 1: the replica holding the prompt's prefix (else the least loaded), or round-robin",
    )
    add_engine_args(serve)
    serve.set_defaults(max_decode_stall=2.5)  # streams first: new prompts join in chunks


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return int(value)
