"""The package's import graph has no circle and keeps its siblings apart, and nothing outside
the engine reads its parts (``python -m lora_guard.tools.layers``)."""

from __future__ import annotations

from pathlib import Path

import lora_guard
from lora_guard.tools.layers import circles, forbidden, import_graph, main, reach_through


def test_the_package_has_no_circle_no_forbidden_import_and_no_reach_through(capsys) -> None:
    assert main(["--quiet"]) == 0
    assert "0 circles, 0 forbidden imports, 0 reach-throughs" in capsys.readouterr().out


def test_router_and_simulator_share_the_ranking_without_importing_each_other() -> None:
    graph = import_graph(Path(lora_guard.__file__).parent)
    simulator = set().union(*(v for k, v in graph.items() if k.startswith("lora_guard.simulate.")))
    assert "lora_guard.routing" in simulator
    assert "lora_guard.routing" in graph["lora_guard.serve_ray.router"]
    assert "lora_guard.workload.trace" in simulator


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_circle_through_a_deferred_import_is_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path / "lora_guard",
        {
            "__init__.py": "",
            "a.py": "from lora_guard.b import thing\n",
            "b.py": "def thing():\n    from lora_guard import a\n",
            "c.py": "import typing\nif typing.TYPE_CHECKING:\n    from lora_guard.a import x\n",
        },
    )
    graph = import_graph(root)
    assert circles(graph) == [["lora_guard.a", "lora_guard.b"]]
    assert graph["lora_guard.c"] == set()  # imports for type checking only do not tie modules


def test_an_import_from_serve_ray_into_bench_is_forbidden(tmp_path: Path) -> None:
    root = _package(
        tmp_path / "lora_guard",
        {
            "__init__.py": "",
            "bench/__init__.py": "",
            "bench/hits.py": "",
            "serve_ray/__init__.py": "",
            "serve_ray/best.py": "from ..bench.hits import x\n",
        },
    )
    assert forbidden(import_graph(root)) == [("lora_guard.serve_ray.best", "lora_guard.bench.hits")]


def test_reading_the_engines_parts_from_a_route_is_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path / "lora_guard",
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/builder.py": "usage = engine.adapters.usage\n",  # the engine's own
            "server/__init__.py": "",
            "server/routes.py": "rows = state.llm.adapters.registry\n"
            "def pin(engine):\n    engine.adapters.usage.pin('a')\n"
            "spec = args.model\n",  # not an engine
        },
    )
    assert reach_through(root) == [
        ("lora_guard.server.routes", 1, "state.llm.adapters"),
        ("lora_guard.server.routes", 3, "engine.adapters"),
    ]
