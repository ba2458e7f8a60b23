"""The four layers import only downwards, and no module imports itself round a cycle.

Read from the source (imports at module level and inside functions alike), so a
lazy import cannot hide a cycle or a layer breach; imports under `if TYPE_CHECKING:`
never run and do not count. See docs/architecture.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("engines", "infra", "tasks", "flows")

# What each layer must never import (its own rule from docs/architecture.md).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "engines": (
        "infra",
        "tasks",
        "flows",
        "prefect",
        "mlflow",
        "fsspec",
        "s3fs",
        "fastapi",
        "httpx",
    ),
    "infra": ("tasks", "flows", "prefect"),
    "tasks": ("flows",),
    "flows": (),
}
# infra/serving speaks the engine's request/response types, and infra/docker_sandbox
# runs the code sandbox's runner inside containers; nothing else in infra may reach
# into engines.
ALLOWED_ENGINE_IMPORTS_IN_INFRA = (
    "engines.inference.types",
    "engines.inference.engine",
    "engines.model",
    "engines.sandbox",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (never imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not _is_type_checking(child))


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def project_modules() -> dict[str, set[str]]:
    modules = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            modules[module_name(path)] = imports_of(path)
    return modules


def test_layers_import_only_downwards():
    breaches = []
    for module, imported in project_modules().items():
        layer = module.split(".")[0]
        for name in imported:
            top = name.split(".")[0]
            if top not in FORBIDDEN[layer]:
                continue
            breaches.append(f"{module} imports {name}")
        if layer == "infra":
            for name in imported:
                if name.startswith("engines.") and not name.startswith(
                    ALLOWED_ENGINE_IMPORTS_IN_INFRA
                ):
                    breaches.append(f"{module} imports {name}")
    assert breaches == []


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_import_cycles():
    modules = project_modules()
    graph = {
        module: {
            target
            for name in imported
            for target in (name, name.rpartition(".")[0])
            if target in modules and target != module
        }
        for module, imported in modules.items()
    }
    cycles = find_cycles(graph)
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    graph = {"flows.train": {"flows.train_sync"}, "flows.train_sync": {"flows.train"}, "x": set()}
    assert find_cycles(graph) == [["flows.train", "flows.train_sync", "flows.train"]]
