"""The Ray Serve application: an ingress that takes the HTTP routes and engine replicas behind it.

``Ingress`` reads the adapter a generation request names (``lora_guard.naming``, the server's own
rule) and the tenant (``lora_guard.tenancy``: ``X-Tenant-Id``, else a gateway's fairness id,
else ``default``), and forwards the request to the engine deployment through its handle with
``multiplexed_model_id="tenant:adapter"``; the request router picks the replica. Each engine
replica runs the lora-guard engine with its policies and answers the request with lora-guard's own
FastAPI application (``asgi.call_app``), streaming included. ``GET /metrics`` gives the fleet's
metrics (``serve_ray.metrics``: counters summed, ratios computed again, other gauges per
replica); the adapter administration routes that change an engine (load, unload, pin) are
refused with 501, since they would reach one replica only.
"""

# No ``from __future__ import annotations``: FastAPI reads the route's annotations at runtime.
import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from lora_guard.naming import OPENAI_GENERATE, TGI_GENERATE, adapter_of, json_object, named_in
from lora_guard.serve_ray.asgi import Forwarded, Head, call_app
from lora_guard.serve_ray.metrics import merge_metrics
from lora_guard.tenancy import header_tenant

if TYPE_CHECKING:
    from lora_guard.engine.outputs import StepRecord

log = logging.getLogger("lora_guard.serve_ray")

ENGINE_DEPLOYMENT = "LoraGuardEngine"
ROUTERS = ("lora-guard", "ray-default")
ROUTER_CLASS = "lora_guard.serve_ray.router:AdapterAffinityRouter"
ADMIN_WRITES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/adapters/")
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
# The engine replica's own bookkeeping of the response; the ingress sends its own.
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})


class EngineReplica:
    """One lora-guard engine, its policies and its routes, built from ``lora-guard serve``
    arguments as ``lora-guard serve`` builds them."""

    def __init__(self, serve_argv: Sequence[str], threads: int) -> None:
        import torch

        from lora_guard.config import load_settings
        from lora_guard.server.app import create_app
        from lora_guard.server.serve import StartError, engine_for, state_for

        torch.set_num_threads(threads)
        settings = load_settings(list(serve_argv))
        try:
            engine, keys, adapter_dirs = engine_for(settings)
            self.state = state_for(engine, settings.plugin_settings(), keys, adapter_dirs)
        except StartError as exc:
            raise RuntimeError(f"lora-guard engine replica: {exc}") from None
        self.state.engine.start()
        self.app = create_app(self.state)

    async def adapter(self, model_id: str) -> str:
        """Ray Serve's multiplexed loader (wrapped in ``serve.multiplexed`` by
        :func:`engine_deployment`): the engine loads the adapter itself when the request runs;
        this tells Ray Serve which model ids the replica serves, for its own router."""
        return model_id

    async def forward(self, request: Forwarded) -> AsyncIterator[Head | bytes]:
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            await self.adapter(model_id)
        async for part in call_app(self.app, request):
            yield part

    async def model_id(self) -> str:
        return self.state.model_id

    async def record_routing_stats(self) -> dict[str, Any]:
        from lora_guard.serve_ray.stats import routing_stats

        stats: dict[str, Any] = await self.state.engine.call(routing_stats)
        stats["max_concurrent_requests"] = self.state.limits.max_concurrent_requests
        return stats

    async def recent_steps(self) -> "list[StepRecord]":
        """The engine's last steps (``LLMEngine.stats.recent_steps``), oldest first: its step
        log, to fit ``lora-guard simulate``'s step cost to (``simulate_costs.fit_steps``)."""
        steps: list[StepRecord] = await self.state.engine.call(
            lambda engine: list(engine.stats.recent_steps)
        )
        return steps

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.ready = False
            state.engine.shutdown()


def replica_actors(app_name: str) -> list[Any]:
    """The Ray actors of the application's engine replicas; each answers
    ``record_routing_stats``."""
    return list(named_replicas(app_name).values())


def named_replicas(app_name: str) -> dict[str, Any]:
    """The application's engine replicas by their Ray Serve id (Ray Serve names the actors
    ``SERVE_REPLICA::app#deployment#id``)."""
    prefix = f"SERVE_REPLICA::{app_name}#{ENGINE_DEPLOYMENT}#"
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    ]
    return {name[len(prefix) :]: ray.get_actor(name, namespace="serve") for name in sorted(names)}


http = FastAPI(title="lora-guard on Ray Serve")


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(http)
class Ingress:
    def __init__(self, engine: DeploymentHandle, app_name: str) -> None:
        self.engine, self.app_name = engine, app_name
        self.base_model: str | None = None

    @http.api_route("/{path:path}", methods=METHODS)
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        path = "/" + path  # below the application's route prefix
        if request.method == "POST" and path.startswith(ADMIN_WRITES):
            message = (
                "adapter administration is not available behind lora-guard serve-ray: it "
                "would change one replica only; give every replica the same adapters at "
                "start"
            )
            return JSONResponse({"error": message, "error_type": "not_supported"}, 501)
        model_id = await self._model_id(path, body, header_tenant(request.headers))
        handle = self.engine.options(stream=True, multiplexed_model_id=model_id or "")
        forwarded = Forwarded(
            request.method, path, request.url.query.encode(), list(request.headers.items()), body
        )
        parts = handle.forward.remote(forwarded)
        try:
            head = await parts.__anext__()
        except Exception as exc:  # no replica could take it (replicas gone, or failing)
            log.warning("no engine replica answered %s %s: %s", request.method, path, exc)
            return JSONResponse(
                {
                    "error": f"no engine replica answered: {type(exc).__name__}",
                    "error_type": "unavailable",
                },
                503,
            )
        assert isinstance(head, Head)
        headers = {k: v for k, v in head.headers if k.lower() not in _HOP_HEADERS}
        if request.method == "GET" and path == "/metrics" and head.status == 200:
            # One replica said the caller may read them (an admin key, with a key file): the
            # fleet's are every replica's, summed.
            async for _ in parts:
                pass
            text = merge_metrics(await self._replica_metrics())
            return Response(text, media_type=headers.get("content-type", "text/plain"))

        async def rest() -> AsyncIterator[bytes]:
            async for part in parts:
                assert isinstance(part, bytes)
                yield part

        return StreamingResponse(rest(), status_code=head.status, headers=headers)

    async def _model_id(self, path: str, body: bytes, tenant: str | None) -> str | None:
        """``tenant:adapter`` of a generation request; None for the base model or another
        route (a body that is not JSON is the engine's to refuse)."""
        if path not in TGI_GENERATE and path not in OPENAI_GENERATE:
            return None
        parsed = json_object(body)
        name = None if parsed is None else named_in(path, parsed)
        if name is None:
            return None
        if self.base_model is None:
            self.base_model = await self.engine.model_id.remote()
        adapter = adapter_of(name, self.base_model)
        if adapter is None:
            return None
        return f"{tenant or 'default'}:{adapter}"

    async def _replica_metrics(self) -> dict[str, str]:
        """Each replica's Prometheus text, by its id."""
        replicas = named_replicas(self.app_name)
        stats = await asyncio.gather(*(a.record_routing_stats.remote() for a in replicas.values()))
        return {
            replica: str(s.get("metrics", "")) for replica, s in zip(replicas, stats, strict=True)
        }


def fleet_stats(app_name: str) -> list[dict[str, Any]]:
    """Every engine replica's routing stats now (``stats.routing_stats``), from the driver."""
    return list(ray.get([a.record_routing_stats.remote() for a in replica_actors(app_name)]))


def engine_deployment(
    serve_argv: Sequence[str],
    replicas: int,
    router: str = "lora-guard",
    replica_cpus: float = 1.0,
    threads: int = 1,
    max_ongoing_requests: int | None = None,
    stats_period_s: float = 1.0,
    spread_queue: int | None = None,
    reservation_s: float = 10.0,
) -> Any:
    """The engine deployment: ``replicas`` engine replicas behind ``router`` (``lora-guard``: the
    adapter-affinity router; ``ray-default``: Ray Serve's power of two choices with its
    multiplexed ranking).

    A replica takes ``max_ongoing_requests`` at once (default: the engine's
    ``max_concurrent_requests``, beyond which it would answer 429); a hot adapter spreads to
    another replica once every replica holding it has ``spread_queue`` requests (default: the
    engine's ``max_num_seqs``, a full batch, so that requests would wait)."""
    from lora_guard.config import load_settings

    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose from {', '.join(ROUTERS)}")
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    settings = load_settings(list(serve_argv))  # the arguments are checked here, once
    if settings.engine_kwargs()["model"] is None:  # the demo model: prepared once, here
        from lora_guard.demo.model import DemoError, prepare_demo

        try:
            prepare_demo()
        except DemoError as exc:
            raise ValueError(str(exc)) from None
    seats = int(settings.max_loras) or -1  # Ray's multiplexer: -1 is no cap, as 0 is here
    if max_ongoing_requests is None:
        max_ongoing_requests = int(settings.max_concurrent_requests)
    if spread_queue is None:
        spread_queue = int(settings.max_num_seqs)
    if router == "lora-guard":
        config = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"spread_queue": spread_queue, "reservation_s": reservation_s},
            request_routing_stats_period_s=stats_period_s,
        )
    else:
        config = RequestRouterConfig(request_routing_stats_period_s=stats_period_s)

    class LoraGuardEngineReplica(EngineReplica):
        @serve.multiplexed(max_num_models_per_replica=seats)  # type: ignore[untyped-decorator]
        async def adapter(self, model_id: str) -> str:
            return model_id

    return serve.deployment(
        LoraGuardEngineReplica,
        name=ENGINE_DEPLOYMENT,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus},
        max_ongoing_requests=max_ongoing_requests,
        request_router_config=config,
    ).bind(list(serve_argv), threads)


def build_app(
    serve_argv: Sequence[str] = (), replicas: int = 2, app_name: str = "lora-guard", **options: Any
) -> Any:
    """The application to ``serve.run``: ``serve_argv`` are ``lora-guard serve`` arguments (the
    model, adapters, policies and limits of every replica); ``options`` go to
    :func:`engine_deployment`."""
    ingress: Any = Ingress  # a Ray Serve deployment: mypy does not see class decorators
    return ingress.bind(engine_deployment(serve_argv, replicas, **options), app_name)
