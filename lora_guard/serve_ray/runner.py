"""``lora-guard serve-ray``: Ray, then Ray Serve's HTTP proxy, then the application, until
SIGTERM or Ctrl-C.

Its own flags come first (``--replicas`` and the rest below); every other argument is a
``lora-guard serve`` setting, given to each engine replica (``--host`` and ``--port`` are Ray
Serve's HTTP proxy's).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import ray
from ray import serve

from lora_guard.config import SettingsError, load_settings
from lora_guard.serve_ray.app import ROUTERS, build_app

APP_NAME = "lora-guard"


def start(
    serve_argv: Sequence[str] = (),
    replicas: int = 2,
    *,
    ray_address: str | None = None,
    ray_cpus: int | None = None,
    app_name: str = APP_NAME,
    route_prefix: str = "/",
    **options: Any,
) -> str:
    """Deploy ``replicas`` engine replicas and the ingress; return the URL they answer on.

    Uses the Ray this process is connected to, else ``ray_address``, else starts a local one
    (``ray_cpus`` CPUs, no dashboard). Ray Serve's HTTP proxy listens on the settings' ``--host``
    and ``--port``, the application under ``route_prefix``. ``options`` go to
    ``app.engine_deployment``."""
    settings = load_settings(list(serve_argv))
    connect(ray_address, ray_cpus)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    app = build_app(serve_argv, replicas, app_name=app_name, **options)
    serve.run(app, name=app_name, route_prefix=route_prefix, blocking=False)
    return f"http://{settings.host}:{settings.port}{route_prefix.rstrip('/')}"


def connect(ray_address: str | None = None, ray_cpus: int | None = None) -> None:
    """Ray for this process: the one it is connected to, else ``ray_address``, else a local
    one with ``ray_cpus`` CPUs and no dashboard."""
    if not ray.is_initialized():
        ray.init(address=ray_address, num_cpus=ray_cpus, include_dashboard=False)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lora-guard serve-ray",
        allow_abbrev=False,  # an abbreviated `serve` setting is the replicas', never taken here
        description="lora-guard engine replicas behind Ray Serve, with the adapter-affinity "
        "request router; arguments other than these are `lora-guard serve` settings, given to "
        "every replica (see docs/scale-out.md)",
    )
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument(
        "--router",
        choices=ROUTERS,
        default="lora-guard",
        help="lora-guard (adapter affinity, default) or ray-default",
    )
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica (default 1)")
    p.add_argument(
        "--max-ongoing-requests",
        type=int,
        help="requests one replica takes at once (default: --max-concurrent-requests)",
    )
    p.add_argument(
        "--stats-period",
        type=float,
        default=1.0,
        help="seconds between two routing-stats reports of a replica (default 1)",
    )
    p.add_argument(
        "--spread-queue",
        type=int,
        help="a hot adapter spreads to more replicas once those holding it have this "
        "many requests each (default: --max-num-seqs)",
    )
    p.add_argument("--ray-address", help="a running Ray cluster (default: start a local Ray)")
    p.add_argument("--ray-cpus", type=int, help="CPUs of the local Ray (default: all)")
    return p


#: the flags that set ``app.engine_deployment``'s option of the same name
_DEPLOYMENT_FLAGS = "router replica_cpus threads max_ongoing_requests spread_queue"


def main(argv: Sequence[str]) -> int:
    args, serve_argv = parser().parse_known_args(list(argv))
    small = [
        name
        for name in ("replicas", "threads", "max_ongoing_requests", "spread_queue")
        if getattr(args, name) is not None and getattr(args, name) < 1
    ]
    if small or args.stats_period <= 0 or args.replica_cpus < 0:
        what = (
            f"--{small[0].replace('_', '-')} must be at least 1"
            if small
            else ("--stats-period must be positive and --replica-cpus at least 0")
        )
        print(f"lora-guard serve-ray: error: {what}", file=sys.stderr)
        return 2
    try:
        load_settings(serve_argv)
    except SettingsError as exc:
        print(f"lora-guard serve-ray: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    try:
        connect(args.ray_address, args.ray_cpus)
        for sig in (signal.SIGINT, signal.SIGTERM):  # after Ray's start, so that they are ours
            signal.signal(sig, lambda *_: stop.set())
        deployment = {name: getattr(args, name) for name in _DEPLOYMENT_FLAGS.split()}
        url = start(serve_argv, args.replicas, **deployment, stats_period_s=args.stats_period)
    except Exception as exc:  # a replica that cannot start fails the deployment
        print(f"lora-guard serve-ray: error: {exc}", file=sys.stderr)
        _shutdown()
        return 1
    print(
        f"lora-guard serve-ray: {args.replicas} replicas on {url} (router {args.router})",
        flush=True,
    )
    while not stop.wait(1.0):
        pass
    _shutdown()
    return 0


def _shutdown() -> None:
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
