"""The import graph of ``lora_guard``: its circles, imports the layering forbids, and reads of the
engine's parts from outside it.

``python -m lora_guard.tools.layers`` prints one line per module with what it imports, then every
circle, every forbidden import and every reach-through, and exits 1 if there is one. Imports
under ``if TYPE_CHECKING:`` do not count; imports inside functions do (a deferred import still
ties the two modules). A reach-through is ``engine.adapters`` (``blocks``, ``pool``, ``model``)
outside ``lora_guard.engine``, on anything named ``engine`` or ``llm``: callers ask the engine's
methods (``lora_guard.engine.queries``) instead.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import lora_guard

# (importer prefix, imported prefix): siblings that must not lean on each other.
FORBIDDEN: tuple[tuple[str, str], ...] = (
    ("lora_guard.serve_ray", "lora_guard.bench"),
    ("lora_guard.simulate", "lora_guard.serve_ray"),
    ("lora_guard.engine", "lora_guard.server"),
    ("lora_guard.engine", "lora_guard.bench"),
    ("lora_guard.engine", "lora_guard.demo"),
    ("lora_guard.workload", "lora_guard.bench"),
)

#: the engine's parts: only the engine's own modules read them
ENGINE_PARTS = frozenset({"adapters", "blocks", "pool", "model"})
ENGINE_NAMES = frozenset({"engine", "llm"})  # what callers call an LLMEngine

Graph = dict[str, set[str]]


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from (i for n in node.orelse for i in _imports_in(n))
            continue
        yield from _imports_in(node)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest known module that ``name`` names (``a.b.func`` -> ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def import_graph(root: Path) -> Graph:
    """Each module of the package to the package modules it imports."""
    modules = module_files(root)
    graph: Graph = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = _package_of(module, path).split(".")
                    base = ".".join(package[: len(package) - node.level + 1] + [base] * bool(base))
                names = [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                inside = name == root.name or name.startswith(root.name + ".")
                target = _resolve(name, modules) if inside else None
                if target is not None and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def forbidden(graph: Graph) -> list[tuple[str, str]]:
    """Every import from one side of a ``FORBIDDEN`` pair to the other."""
    return sorted(
        (source, target)
        for source, targets in graph.items()
        for target in targets
        for importer, imported in FORBIDDEN
        if _under(source, importer) and _under(target, imported)
    )


def reach_through(root: Path) -> list[tuple[str, int, str]]:
    """``(module, line, expression)`` for each read of an engine part outside the engine."""
    found = []
    for module, path in module_files(root).items():
        if _under(module, f"{root.name}.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ENGINE_NAMES:
                found.append((module, node.lineno, ast.unparse(node)))
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lora_guard.tools.layers", description=__doc__)
    parser.add_argument("--quiet", action="store_true", help="print only circles and violations")
    args = parser.parse_args(argv)
    root = Path(lora_guard.__file__).parent
    graph = import_graph(root)
    if not args.quiet:
        for module in sorted(graph):
            print(f"{module}: {' '.join(sorted(graph[module])) or '-'}")
    loops, bad, reads = circles(graph), forbidden(graph), reach_through(root)
    for loop in loops:
        print("circle: " + " <-> ".join(loop))
    for source, target in bad:
        print(f"forbidden: {source} imports {target}")
    for module, line, expression in reads:
        print(f"reach-through: {module}:{line} reads {expression}")
    print(
        f"{len(graph)} modules, {len(loops)} circles, {len(bad)} forbidden imports, "
        f"{len(reads)} reach-throughs"
    )
    return 1 if loops or bad or reads else 0


if __name__ == "__main__":
    sys.exit(main())
