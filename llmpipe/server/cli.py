"""`llmpipe serve`: load the model, then serve it over HTTP until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Callable

from llmpipe.server.http import BODY_TIMEOUT_S, HEADER_TIMEOUT_S


def add_serve_parser(sub) -> None:
    from llmpipe.cli import add_engine_args

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with /metrics and a web playground")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health and / (docs included)")
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
    add_engine_args(serve)
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace, before_step: Callable[[], None] | None = None) -> None:
    """`before_step`: see AsyncEngine (tests pace the engine with it)."""
    import uvicorn

    from llmpipe.cli import engine_kwargs
    from llmpipe.llm import LLM
    from llmpipe.server.app import create_app
    from llmpipe.server.http import uvicorn_config

    class DrainingServer(uvicorn.Server):
        """On SIGINT / SIGTERM: keep listening while in-flight requests get --shutdown-timeout seconds
        to finish; meanwhile /health and new requests get 503 "shutting down", so a load balancer
        sees the drain. Then end the rest with an error event (streams) or a 503, and exit 0.
        A second signal exits at once."""

        draining = False

        def handle_exit(self, sig: int, frame) -> None:
            if self.draining:
                return super().handle_exit(sig, frame)
            self.draining = True
            app.state.server.engine.drain_threadsafe(args.shutdown_timeout, lambda: self.stop(sig))

        def stop(self, sig: int) -> None:
            super().handle_exit(sig, None)

    llm = LLM(args.model, **engine_kwargs(args))
    app = create_app(
        llm,
        args.served_model_name or args.model,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        body_timeout=args.body_timeout,
        before_step=before_step,
    )
    print(f"llmpipe: serving {args.model} on http://{args.host}:{args.port} (playground at /)", file=sys.stderr)
    config = uvicorn_config(
        app,
        header_timeout=args.header_timeout,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    # uvicorn re-raises the signal it caught once it has shut down; by then there is nothing left to do.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    DrainingServer(config).run()
