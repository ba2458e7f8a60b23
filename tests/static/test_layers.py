"""The four layers import only downwards, through the one `sluice` package, the rooms of
tasks/ keep to their own (a role's room imports no other role's, a run's files import no
role, the process room enters a role's room only where it starts its process, a role's
room is entered only through its interface, and no room uses another's private names),
the sub-packages of engines/ import only the rooms their
row of `ENGINE_ROOMS` names, and no module imports itself round a cycle.

Read from the source (imports at module level and inside functions alike), so a
lazy import cannot hide a cycle or a layer breach; imports under `if TYPE_CHECKING:`
never run and do not count. See docs/architecture.md.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("engines", "infra", "tasks", "flows")
PACKAGE = "sluice"

# What each layer must never import (its own rule from docs/architecture.md); a
# Sluice layer is named by its import name, `sluice.<layer>`.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "engines": (
        "sluice.infra",
        "sluice.tasks",
        "sluice.flows",
        "prefect",
        "mlflow",
        "fsspec",
        "s3fs",
        "fastapi",
        "httpx",
    ),
    "infra": ("sluice.tasks", "sluice.flows", "prefect"),
    "tasks": ("sluice.flows",),
    "flows": (),
}
# infra/serving speaks the engine's request/response types, and infra/docker_sandbox
# runs the code sandbox's runner inside containers; nothing else in infra may reach
# into engines.
ALLOWED_ENGINE_IMPORTS_IN_INFRA = (
    "sluice.engines.inference.types",
    "sluice.engines.inference.engine",
    "sluice.engines.inference.weight_sync",  # serving/weight_routes: the transfer format
    "sluice.engines.policy.model",
    "sluice.engines.env.sandbox",
    "sluice.engines.trajectory",  # streams/schema: the row's column names (stdlib only)
)


# The rooms inside tasks/ (docs/architecture.md, "The rooms of tasks/"): one package per
# role, each holding the role and its satellites; the modules several roles share at the
# root of tasks/; a run's files (run/) and starting processes (process/) below them.
ROLE_ROOMS = (
    "sluice.tasks.rollout",
    "sluice.tasks.reward",
    "sluice.tasks.train",
    "sluice.tasks.evaluate",
)
SHARED = (
    "sluice.tasks.role",
    "sluice.tasks.prompts",
    "sluice.tasks.tool_runner",
    "sluice.tasks.call_pool",
    "sluice.tasks.sandbox",
)
"""The modules at the root of tasks/: what several rooms use, which is no role's."""
ROOM_INTERFACES: dict[str, tuple[str, ...]] = {
    # The role, for the process that runs it.
    "sluice.tasks.rollout": ("sluice.tasks.rollout.role",),
    "sluice.tasks.reward": ("sluice.tasks.reward.role",),
    # Both training roles, and the trainer a following rank builds (process/).
    "sluice.tasks.train": (
        "sluice.tasks.train.role",
        "sluice.tasks.train.sync",
        "sluice.tasks.train.factory",
    ),
    # The role, and the held-out evaluation the flows run without it.
    "sluice.tasks.evaluate": ("sluice.tasks.evaluate.role",),
}
"""The only modules of a role's room that a module outside the room may import."""
TASK_ROOMS: dict[str, tuple[str, ...]] = {
    # A run's files: read by every room of tasks/ and by the flows, so they import no
    # role (no role's imports ride along) and nothing that starts processes; preparing a
    # run's policy needs its prompts and tools.
    "sluice.tasks.run": ("sluice.tasks.run", "sluice.tasks.prompts", "sluice.tasks.tool_runner"),
    # Starting and supervising the roles' processes: what it needs of a role is the
    # shared shape (role.py), where it is.
    "sluice.tasks.process": ("sluice.tasks.process", "sluice.tasks.run", "sluice.tasks.role"),
    # What the roles share imports no role.
    **{shared: ("sluice.tasks.run", *SHARED) for shared in SHARED},
    # A role's room: itself, what is shared, a run's files, and the processes it starts
    # (the rollout's servers, the trainer's following ranks); never another role's room.
    **{room: (room, "sluice.tasks.run", "sluice.tasks.process", *SHARED) for room in ROLE_ROOMS},
}
"""What of `sluice.tasks` each room of tasks/ may import (besides the package name)."""
ENTRANCES: dict[str, tuple[str, ...]] = {
    # The entry point of a role process imports the role it starts.
    "sluice.tasks.process.worker": (
        "sluice.tasks.rollout.role",
        "sluice.tasks.reward.role",
        "sluice.tasks.train.role",
        "sluice.tasks.train.sync",
        "sluice.tasks.evaluate.role",
    ),
    # A split trainer's following ranks build the trainer the train role builds.
    "sluice.tasks.process.following_ranks": ("sluice.tasks.train.factory",),
    "sluice.tasks.process.ray_ranks": ("sluice.tasks.train.factory",),
}
"""The modules of tasks/process that enter a role's room, because they start its process,
and the interface modules each may import beyond its room's row of `TASK_ROOMS`."""


# The rooms of engines/ (its sub-packages, and its root modules by their own name), in
# the order their arrows point: each may import only the rooms its row names (besides
# itself), which are below it in `ENGINE_ORDER` but for the known exceptions under it.
ENGINE_ROOMS: dict[str, tuple[str, ...]] = {
    # The data contract every room reads: a trajectory row, standard library only.
    "trajectory": (),
    # Generation; "policy" is the known upward arrow below (LoRA adapters).
    "inference": ("trajectory", "policy"),
    # Problems, verifiers, tools and episodes, which generate through the engine's types.
    "env": ("trajectory", "inference"),
    # The policy's files and its warm start, which runs episodes on the engine.
    "policy": ("env", "inference"),
    # The RL math, the samples built from episodes, the trainer step (and LoRA training).
    "rl": ("trajectory", "env", "policy"),
    # Backends and tools built on the trainer step and the engine's weights and profile.
    "megatron": ("rl", "inference"),
    "planner": ("rl", "inference"),
}
"""What each room of engines/ may import of `sluice.engines` (rooms by name)."""
ENGINE_ORDER = ("trajectory", "inference", "env", "policy", "rl", "megatron", "planner")
"""The rooms of engines/ from the bottom up: an allowed arrow points down this order."""
KNOWN_UPWARD_ARROWS = {
    # A circle, left visible rather than hidden: inference/engine.py loads LoRA adapters
    # through policy/adapter.py (which reads files with inference/weights.py), while
    # policy/warm_checks.py runs episodes (env) on the engine, and env/episodes.py speaks
    # inference/types.py. So env, inference and policy form one strongly connected set
    # until the policy's file formats (adapter) and its warm-start tooling part rooms.
    ("inference", "policy"),
}
"""Allowed arrows that point up `ENGINE_ORDER`: known circles, each to be removed."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


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


@functools.cache
def project_modules() -> dict[str, set[str]]:
    """Every module's imports, read once per session (the tests only read the result)."""
    modules = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            modules[module_name(path)] = imports_of(path)
    return modules


def forbidden(name: str, rules: tuple[str, ...]) -> bool:
    return any(name == rule or name.startswith(rule + ".") for rule in rules)


def test_layers_import_only_downwards():
    breaches = []
    for module, imported in project_modules().items():
        layer = module.split(".")[1]
        breaches += [
            f"{module} imports {name}" for name in imported if forbidden(name, FORBIDDEN[layer])
        ]
        if layer == "infra":
            for name in imported:
                if name.startswith("sluice.engines.") and not name.startswith(
                    ALLOWED_ENGINE_IMPORTS_IN_INFRA
                ):
                    breaches.append(f"{module} imports {name}")
    assert breaches == []


def task_room(name: str) -> str | None:
    """The room of tasks/ an import name lies in (None: outside tasks/, or the package)."""
    return next((room for room in TASK_ROOMS if forbidden(name, (room,))), None)


def task_room_breaches(modules: dict[str, set[str]]) -> list[str]:
    """`module imports name` for each import of `sluice.tasks` a room of tasks/ may not make."""
    breaches = []
    for module, imported in modules.items():
        room = task_room(module)
        if room is None:
            continue
        allowed = (*TASK_ROOMS[room], *ENTRANCES.get(module, ()))
        breaches += [
            f"{module} imports {name}"
            for name in imported
            if forbidden(name, ("sluice.tasks",))
            and name != "sluice.tasks"
            and not forbidden(name, allowed)
        ]
    return breaches


def test_the_rooms_of_tasks_import_no_role_but_where_one_is_started():
    breaches = task_room_breaches(project_modules())
    assert breaches == [], "\n".join(breaches)


def interface_breaches(modules: dict[str, set[str]]) -> list[str]:
    """`module imports name` for each import of a role's room from outside it (tasks/ or
    the flows) that does not go through the room's interface (`ROOM_INTERFACES`)."""
    breaches = []
    for module, imported in modules.items():
        for name in sorted(imported):
            room = task_room(name)
            if room not in ROOM_INTERFACES or forbidden(module, (room,)):
                continue
            if name != room and not forbidden(name, ROOM_INTERFACES[room]):
                breaches.append(f"{module} imports {name}: not the interface of {room}")
    return breaches


def test_a_role_room_is_entered_only_through_its_interface():
    breaches = interface_breaches(project_modules())
    assert breaches == [], "\n".join(breaches)


def private_names_of(path: Path) -> set[str]:
    """The private names (`_x`) a module reaches in another module: imported by name
    (`from m import _x`) or read off an imported module (`m._x`), as dotted names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in _runtime_nodes(tree):
        value = node.value if isinstance(node, ast.Attribute) else None
        if isinstance(value, ast.Name) and value.id in bound:
            found.add(f"{bound[value.id]}.{node.attr}")
    found.update(bound.values())
    return {name for name in found if is_private(name)}


def is_private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def private_breaches(uses: dict[str, set[str]]) -> list[str]:
    """`module uses name` for each private name of a room of tasks/ used from outside it."""
    breaches = []
    for module, names in uses.items():
        for name in sorted(names):
            room = task_room(name)
            shared = name.startswith("sluice.tasks.") and name.count(".") >= 2
            owner = room or (".".join(name.split(".")[:3]) if shared else None)
            if owner is not None and not forbidden(module, (owner,)) and is_private(name):
                breaches.append(f"{module} uses {name}, private to {owner}")
    return breaches


def test_no_room_of_tasks_uses_a_private_name_of_another():
    uses = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            uses[module_name(path)] = private_names_of(path)
    breaches = private_breaches(uses)
    assert breaches == [], "\n".join(breaches)


def test_the_task_room_checks_find_a_breach():
    breaches = task_room_breaches(
        {
            "sluice.tasks.run.retention": {"sluice.tasks.evaluate.role", "sluice.tasks.run.paths"},
            "sluice.tasks.run.paths": {"sluice.tasks.process.ports"},
            "sluice.tasks.process.servers": {
                "sluice.tasks.rollout.weights.ServedWeights",
                "sluice.tasks.role",
                "sluice.tasks.run.paths",
            },
            "sluice.tasks.process.worker": {"sluice.tasks.rollout.role", "sluice.tasks.train.sync"},
            "sluice.tasks.process.ray_ranks": {"sluice.tasks.train.role"},
            "sluice.tasks.rollout.transfer": {"sluice.tasks.train.sender.WeightSender"},
            "sluice.tasks.train.base": {"sluice.tasks.train.factory", "sluice.tasks.prompts"},
            "sluice.tasks.prompts": {"sluice.tasks.reward.role"},
        }
    )
    assert sorted(breaches) == [
        "sluice.tasks.process.ray_ranks imports sluice.tasks.train.role",
        "sluice.tasks.process.servers imports sluice.tasks.rollout.weights.ServedWeights",
        "sluice.tasks.prompts imports sluice.tasks.reward.role",
        "sluice.tasks.rollout.transfer imports sluice.tasks.train.sender.WeightSender",
        "sluice.tasks.run.paths imports sluice.tasks.process.ports",
        "sluice.tasks.run.retention imports sluice.tasks.evaluate.role",
    ]
    assert interface_breaches(
        {
            "sluice.flows.evaluate": {"sluice.tasks.evaluate.role.evaluate_version"},
            "sluice.flows.train": {"sluice.tasks.train.publisher.Publisher"},
            "sluice.tasks.train.role": {"sluice.tasks.train.publisher"},
        }
    ) == [
        "sluice.flows.train imports sluice.tasks.train.publisher.Publisher: "
        "not the interface of sluice.tasks.train"
    ]
    assert private_breaches(
        {
            "sluice.tasks.rollout.transfer": {"sluice.tasks.train.sender._held"},
            "sluice.flows.train": {"sluice.tasks.run.paths._cached"},
            "sluice.tasks.reward.role": {"sluice.tasks.call_pool._join"},
            "sluice.tasks.train.role": {"sluice.tasks.train.base._x"},
        }
    ) == [
        "sluice.tasks.rollout.transfer uses sluice.tasks.train.sender._held, "
        "private to sluice.tasks.train",
        "sluice.flows.train uses sluice.tasks.run.paths._cached, private to sluice.tasks.run",
        "sluice.tasks.reward.role uses sluice.tasks.call_pool._join, "
        "private to sluice.tasks.call_pool",
    ]
    # The rules name real modules: a renamed one would leave a rule that allows nothing.
    modules = project_modules()
    named = (
        *(m for m in ENTRANCES),
        *(a for row in ENTRANCES.values() for a in row),
        *(a for row in ROOM_INTERFACES.values() for a in row),
        *SHARED,
        *ROLE_ROOMS,
    )
    for name in named:
        assert name in modules, name
    # Every package of tasks/ is a room of the table, so a new one gets a row, not a pass.
    packages = {m for m in modules if m.count(".") == 2 and m.startswith("sluice.tasks.")}
    assert packages - set(SHARED) == {room for room in TASK_ROOMS if room not in SHARED}


def test_every_module_imports_sluice_by_its_package_name():
    # A bare `engines` or `tasks` import would load a second copy of a module from the
    # working directory, or a user's own `tasks.py` in its place.
    bare = [
        f"{module} imports {name}"
        for module, imported in project_modules().items()
        for name in imported
        if name.split(".")[0] in LAYERS
    ]
    assert bare == []


def test_the_layer_check_finds_a_breach():
    assert forbidden("sluice.infra.config", FORBIDDEN["engines"])
    assert forbidden("prefect.flows", FORBIDDEN["infra"])
    assert not forbidden("sluice.infrastructure", FORBIDDEN["engines"])
    assert module_name(ROOT / "engines" / "rl" / "loss.py") == "sluice.engines.rl.loss"
    assert "sluice.engines.rl.loss" in project_modules()
    # The graph has edges: a check over a graph without them would pass vacuously.
    assert "sluice.engines.rl.advantages" in project_modules()["sluice.engines.rl.samples"]


def engine_room(name: str) -> str | None:
    """The room of engines/ an import name lies in (None: outside engines/, or the
    package itself)."""
    parts = name.split(".")
    return parts[2] if parts[:2] == [PACKAGE, "engines"] and len(parts) > 2 else None


def engine_room_breaches(modules: dict[str, set[str]]) -> list[str]:
    """`module imports name` for each import of another room of engines/ that the
    importing room's row of `ENGINE_ROOMS` does not name (or from a room not in it)."""
    breaches = []
    for module, imported in modules.items():
        room = engine_room(module)
        if room is None:
            continue
        allowed = ENGINE_ROOMS.get(room, ())
        for name in sorted(imported):
            target = engine_room(name)
            if target is not None and target != room and target not in allowed:
                rooms = ", ".join(allowed) or "no other room"
                breaches.append(
                    f"{module} imports {name}: engines/{room} may import {rooms} (ENGINE_ROOMS)"
                )
    return breaches


def test_the_rooms_of_engines_import_only_the_rooms_their_row_names():
    breaches = engine_room_breaches(project_modules())
    assert breaches == [], "\n".join(breaches)


def test_the_engine_rooms_table_points_down_but_for_the_known_circles():
    modules = project_modules()
    rooms = {engine_room(m) for m in modules} - {None}
    # Every room is in the table, so a new sub-package gets a row rather than a pass.
    assert rooms == set(ENGINE_ROOMS) == set(ENGINE_ORDER)
    upward = {
        (room, target)
        for room, allowed in ENGINE_ROOMS.items()
        for target in allowed
        if ENGINE_ORDER.index(target) > ENGINE_ORDER.index(room)
    }
    assert upward == KNOWN_UPWARD_ARROWS
    # A known circle that the code no longer has leaves the table: the exception must
    # not outlive it.
    arrows = {
        (engine_room(m), engine_room(n))
        for m, imported in modules.items()
        for n in imported
        if engine_room(m) and engine_room(n) and engine_room(m) != engine_room(n)
    }
    assert arrows >= KNOWN_UPWARD_ARROWS


def test_the_engine_room_check_finds_a_breach():
    breaches = engine_room_breaches(
        {
            "sluice.engines.trajectory": {"sluice.engines.rl.groups.GroupKey"},
            "sluice.engines.env.episodes": {"sluice.engines.inference.types", "sluice.engines"},
            "sluice.engines.rl.loss": {"sluice.engines.rl.objectives", "sluice.engines.megatron"},
            "sluice.engines.lab.x": {"sluice.engines.trajectory"},
            "sluice.infra.config": {"sluice.engines.planner.search"},
        }
    )
    assert breaches == [
        "sluice.engines.trajectory imports sluice.engines.rl.groups.GroupKey: "
        "engines/trajectory may import no other room (ENGINE_ROOMS)",
        "sluice.engines.rl.loss imports sluice.engines.megatron: "
        "engines/rl may import trajectory, env, policy (ENGINE_ROOMS)",
        "sluice.engines.lab.x imports sluice.engines.trajectory: "
        "engines/lab may import no other room (ENGINE_ROOMS)",
    ]


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
    graph = {
        "sluice.flows.train": {"sluice.flows.train_sync"},
        "sluice.flows.train_sync": {"sluice.flows.train"},
        "x": set(),
    }
    assert find_cycles(graph) == [
        ["sluice.flows.train", "sluice.flows.train_sync", "sluice.flows.train"]
    ]
