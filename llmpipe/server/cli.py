"""`llmpipe serve`: load the model, then serve it over HTTP until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Callable

from llmpipe.server.serve_args import add_serve_args


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with /metrics and a web playground")
    add_serve_args(serve)
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace, before_step: Callable[[], None] | None = None) -> None:
    """Start the engine core process (or, with --data-parallel-size N, N engine replicas on Ray Serve:
    llmpipe/deploy/), then serve HTTP from this one until SIGINT / SIGTERM, or until the core dies (then
    every request in flight gets an error and the server exits with status 1, for a supervisor to restart it).
    `before_step`: see CoreLoop (tests pace the engine with it); it runs in the core process, so it must be
    picklable."""
    # SIGINT or SIGTERM while loading stops it as Ctrl-C does (KeyboardInterrupt unwinds what has
    # started), even where SIGINT came in ignored (a script's background job): uvicorn honours both
    # once serving, so the signals mean the same before that.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    import uvicorn

    from llmpipe.engine_args import engine_kwargs
    from llmpipe.config import EngineConfig
    from llmpipe.engine.core_client import ProcessCoreClient
    from llmpipe.engine.encoder_core import serving_tokenizer
    from llmpipe.server.app import create_app
    from llmpipe.server.async_engine import AsyncEngine
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

    config = EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))
    tokenizer = serving_tokenizer(config.model)  # the API side's; the core loads the weights
    if args.data_parallel_size > 1:
        from llmpipe.deploy.ray import data_parallel_client, stop_replicas

        client = data_parallel_client(args, before_step)

        def close() -> None:
            stop_replicas(client.handles)
    else:
        client = ProcessCoreClient(config, before_step)
        close = client.close
    engine = AsyncEngine(client, tokenizer, args.max_waiting)
    app = create_app(
        engine,
        args.served_model_name or args.model,
        api_key=args.api_key,
        body_timeout=args.body_timeout,
        tool_call_parser=args.tool_call_parser,
    )
    print(f"llmpipe: serving {args.model} on http://{args.host}:{args.port} (playground at /)", file=sys.stderr)
    uvicorn_settings = uvicorn_config(
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
    server = DrainingServer(uvicorn_settings)
    core_died: list[str] = []

    def on_core_death(reason: str) -> None:
        core_died.append(reason)
        server.should_exit = True

    engine.on_core_death = on_core_death
    try:
        server.run()
    finally:
        close()
    if core_died:
        print(f"llmpipe: error: {core_died[0]}; the server stopped", file=sys.stderr)
        sys.exit(1)
