"""lora-guard replicas behind Ray Serve (``pip install 'lora-guard[ray]'``; docs/scale-out.md).

The adapter-affinity ranking of replicas lives in ``lora_guard.routing`` (shared with
``lora-guard simulate``), the fewest loads any router could make on a trace in
``lora_guard.workload.bounds``. Without Ray: ``stats`` (what a replica reports, and how the router
reads it), ``asgi`` (a request through an ASGI application in process) and ``metrics`` (the
fleet's summed Prometheus samples).
With Ray: ``router`` (the ``RequestRouter``), ``app`` (the ingress and engine deployments) and
``runner`` (``lora-guard serve-ray``). ``build_app`` and ``run`` below import Ray when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def build_app(serve_argv: Sequence[str] = (), replicas: int = 2, **options: Any) -> Any:
    """The Ray Serve application (``serve.run(build_app([...], replicas=2))``): an ingress with
    lora-guard's HTTP routes and ``replicas`` engine replicas, each built from ``serve_argv``
    (``lora-guard serve`` arguments). See ``lora_guard.serve_ray.app.build_app``."""
    from lora_guard.serve_ray.app import build_app as build

    return build(serve_argv, replicas, **options)


def run(serve_argv: Sequence[str] = (), replicas: int = 2, **options: Any) -> str:
    """Start the application on the running Ray (or a local one) and return its URL; see
    ``lora_guard.serve_ray.runner.start``."""
    from lora_guard.serve_ray.runner import start

    return start(serve_argv, replicas, **options)
