"""Data-parallel serving on Ray Serve: N engine replicas (replica.py), each with its own engine core and
KV cache, behind one OpenAI-compatible ingress that routes by prefix-cache affinity (router.py).

Two ways in, one client (client.py) and one FastAPI app (server/app.py) in both:
- `llmpipe serve --data-parallel-size N`: Ray on this machine, the replicas as Serve applications, the
  HTTP server in the CLI's process as for one engine (`serve_data_parallel`).
- `build_app(args)`: a Ray Serve application for an existing cluster (`serve run
  llmpipe.deploy.ray:build_app model=... data_parallel_size=2`, or a Serve config file / KubeRay
  RayService: deploy/rayservice.yaml), the ingress a Serve deployment behind Serve's HTTP proxy.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Sequence

from llmpipe.errors import LLMPipeError

CLOSE_TIMEOUT_S = 10.0


def require_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise LLMPipeError("--data-parallel-size > 1 runs the replicas on Ray Serve: pip install 'llmpipe[ray]'") from None
    return ray, serve


def replica_app(index: int, engine_kwargs: dict, num_cpus: float, before_step: Callable[[], None] | None = None):
    """One engine replica as a Serve deployment (Serve restarts it if its actor or engine dies)."""
    from llmpipe.deploy.replica import EngineReplica

    _, serve = require_ray()
    deployment = serve.deployment(
        EngineReplica, name=f"llmpipe-replica-{index}", num_replicas=1, max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": num_cpus}, health_check_period_s=2, health_check_timeout_s=60,
    )
    return deployment.bind(engine_kwargs, before_step)


def serve_options(args: dict[str, Any]) -> argparse.Namespace:
    """`llmpipe serve`'s options (defaults included) from a dict of their snake_case names."""
    from llmpipe.server.serve_args import add_serve_args

    parser = argparse.ArgumentParser(prog="llmpipe serve")
    add_serve_args(parser)
    parsed = parser.parse_args(["--model", str(args.get("model", "smollm2-135m-instruct"))])
    unknown = sorted(set(args) - set(vars(parsed)))
    if unknown:
        raise LLMPipeError(f"unknown llmpipe serve option(s): {', '.join(unknown)}")
    actions = {action.dest: action for action in parser._actions}
    for name, value in args.items():
        setattr(parsed, name, _typed(actions.get(name), value))
    return parsed


def _typed(action: argparse.Action | None, value: Any) -> Any:
    """A value as its flag would parse it (`serve run ... key=value` passes every value as a string)."""
    if not isinstance(value, str) or action is None:
        return value
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # a switch
        if value.lower() not in ("true", "false", "1", "0"):
            raise LLMPipeError(f"{action.dest} must be true or false, got {value!r}")
        return value.lower() in ("true", "1")
    if value.lower() in ("none", "null") and action.default is None:
        return None
    typed = action.type(value) if action.type else value
    if action.choices is not None and typed not in action.choices:
        raise LLMPipeError(f"{action.dest} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return typed


async def _ingress_app(replicas: list, args: argparse.Namespace):
    """The single server's FastAPI app over the replicas."""
    from llmpipe.deploy.client import DataParallelCoreClient
    from llmpipe.deploy.router import make_router
    from llmpipe.engine.encoder_core import serving_tokenizer
    from llmpipe.server.app import create_app
    from llmpipe.server.async_engine import AsyncEngine

    client = await DataParallelCoreClient.aconnect(replicas, make_router(args.routing, args.block_size))
    engine = AsyncEngine(client, serving_tokenizer(args.model), args.max_waiting)
    return create_app(engine, args.served_model_name or args.model, api_key=args.api_key,
                      body_timeout=args.body_timeout, tool_call_parser=args.tool_call_parser)


def _ingress_class():
    _, serve = require_ray()

    @serve.ingress()
    class OpenAIIngress:
        async def __init__(self, replicas: list, args: argparse.Namespace) -> None:
            self.asgi_app = await _ingress_app(replicas, args)  # (Serve's wrapper owns `app`)

        def __serve_build_asgi_app__(self):
            return self.asgi_app

    return serve.deployment(OpenAIIngress, name="llmpipe-ingress", max_ongoing_requests=100_000)


def build_app(args: dict[str, Any]):
    """Ray Serve application builder: `args` are `llmpipe serve` options by name (data_parallel_size,
    routing, model, tensor_parallel_size, num_threads, api_key, …)."""
    from llmpipe.engine_args import engine_kwargs

    options = serve_options(args)
    kwargs = dict(engine_kwargs(options), model=options.model)
    replicas = [replica_app(i, kwargs, options.num_threads or 1) for i in range(options.data_parallel_size)]
    return _ingress_class().bind(replicas, options)


WORKER_NICENESS = "RAY_worker_niceness"  # Ray's setting, read from the environment of the process that starts it


def start_replicas(options: argparse.Namespace, before_step: Callable[[], None] | None = None) -> list:
    """Ray on this machine (or the cluster RAY_ADDRESS names), the replicas running, their handles."""
    from llmpipe.engine_args import engine_kwargs

    ray, serve = require_ray()
    if not ray.is_initialized():
        # Ray starts its workers at nice 15, as background work; here they are the server's engines,
        # which anything else on the machine would starve (a replica stepped ~10x slower beside two busy loops).
        os.environ.setdefault(WORKER_NICENESS, "0")
        ray.init(include_dashboard=False, logging_level="warning", log_to_driver=False)
        # A cluster may grow; this machine will not, and Ray would wait for the CPUs forever.
        shortfall = None if os.environ.get("RAY_ADDRESS") else cpu_shortfall(ray.cluster_resources().get("CPU", 0), options)
        if shortfall:
            raise LLMPipeError(shortfall)  # (data_parallel_client stops Ray)
    serve.start(proxy_location="Disabled")
    kwargs = dict(engine_kwargs(options), model=options.model)
    targets = [serve.RunTarget(replica_app(i, kwargs, options.num_threads or 1, before_step),
                               name=f"llmpipe-replica-{i}", route_prefix=None)
               for i in range(options.data_parallel_size)]
    return serve.run_many(targets)


def cpu_shortfall(cpus: float, options: argparse.Namespace) -> str | None:
    """Why Ray cannot place the replicas on `cpus` CPUs (each asks for --num-threads), or None."""
    threads = options.num_threads or 1
    needed = options.data_parallel_size * threads
    if needed <= cpus:
        return None
    return (f"--data-parallel-size {options.data_parallel_size} x --num-threads {threads} needs {needed} CPUs, and "
            f"Ray has {cpus:g} here: fewer replicas or threads, or a cluster (RAY_ADDRESS)")


def data_parallel_client(options: argparse.Namespace, before_step: Callable[[], None] | None = None):
    """`llmpipe serve --data-parallel-size N`'s client: the replicas started, routed as --routing says."""
    from llmpipe.deploy.client import DataParallelCoreClient
    from llmpipe.deploy.router import make_router

    require_ray()  # outside the try: a Ray half imported (Ctrl-C meanwhile) cannot be stopped
    router = make_router(options.routing, options.block_size)
    try:
        return DataParallelCoreClient.connect(start_replicas(options, before_step), router)
    except BaseException:
        stop_replicas()
        raise


def stop_replicas(handles: Sequence[Any] = ()) -> None:
    """Serve and Ray shut down; the replicas' step streams (`handles`) ended first, else Serve would
    wait out each replica's graceful-shutdown timeout (20 s) for them."""
    ray, serve = require_ray()
    for handle in handles:
        try:
            handle.close.remote().result(timeout_s=CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a replica that is down has no stream to end
            pass
    serve.shutdown()
    ray.shutdown()
