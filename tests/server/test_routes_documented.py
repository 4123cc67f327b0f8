"""Every route the server answers has its row in docs/api.md's route table, and every row there
is a route it answers."""

from __future__ import annotations

import re
from pathlib import Path

from lora_guard.naming import OPENAI_GENERATE, TGI_GENERATE
from lora_guard.server import routes_openai, routes_tgi
from lora_guard.server.app import ROUTERS

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def served() -> set[tuple[str, str]]:
    return {
        (method, re.sub(r"\{\w+\}", "{id}", route.path))
        for router in ROUTERS
        for route in router.routes
        for method in route.methods  # type: ignore[attr-defined]
    }


def documented() -> set[tuple[str, str]]:
    """The first cells of the route table: `METHOD /path`, and `/sibling` for a path that
    differs only in its last segment."""
    text = DOC.read_text()
    table = text[text.index("| route | body / answer |") :].split("\n\n", 1)[0]
    routes = set()
    for row in table.splitlines()[2:]:
        method, path = "", ""
        for item in re.findall(r"`([^`]+)`", row.split("|")[1]):
            if " " in item:
                method, path = item.split(" ", 1)
            else:
                path = path.rsplit("/", 1)[0] + item
            routes.add((method, path))
    return routes


def test_every_route_is_documented_and_every_documented_route_is_served() -> None:
    assert served() == documented()


def test_the_routes_that_name_an_adapter_are_the_generation_routes() -> None:
    """The Ray ingress routes by the adapter these routes name (``lora_guard.naming``)."""
    generation = {
        route.path  # type: ignore[attr-defined]
        for router in (routes_tgi.router, routes_openai.router)
        for route in router.routes
        if "POST" in route.methods  # type: ignore[attr-defined]
    }
    assert generation == TGI_GENERATE | OPENAI_GENERATE
