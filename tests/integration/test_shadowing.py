"""`sluice train` from a user's project directory: nothing there stands in for Sluice.

A Celery or invoke project holds a `tasks.py`; others hold `engines.py`, `flows.py` or
an `infra/` package. Sluice installs one import package, `sluice`, and starts its role
processes with `python -P`, so those files are never imported in its place, while a
plugin module of the user's in the same directory (`reward.verifier=my_module:fn`)
still is. A role that cannot start stops the run with one line, without retries.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.flows.conftest import tiny_run_overrides

pytestmark = pytest.mark.integration

SHADOWS = {
    "tasks.py": "",
    "engines.py": "",
    "flows.py": "",
    "sluice.py": "",
    "infra/__init__.py": "",
}
TRAP = "raise RuntimeError('the user\\'s {name} was imported in place of Sluice')\n"
PLUGIN = '''
import os


def verify(row, text):
    """Reward 1 for any answer, and leave a trace that this module was called."""
    with open(os.path.join(os.path.dirname(__file__), "calls.txt"), "a") as out:
        out.write("called\\n")
    return 1.0
'''


def user_project(root: Path) -> Path:
    project = root / "project"
    for name in SHADOWS:
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(TRAP.format(name=name))
    (project / "my_verifier.py").write_text(PLUGIN)
    return project


def sluice_train(project: Path, *overrides: str, timeout_s: float) -> subprocess.CompletedProcess:
    """`sluice train` as the user types it, in their project directory."""
    command = shutil.which("sluice")
    assert command is not None, "the sluice console script is not installed"
    env = dict(os.environ, PYTHONPATH="")  # what a user's shell has: no test paths
    args = [command, "train", *(a for o in overrides for a in ("--set", o))]
    try:
        return subprocess.run(
            args, cwd=project, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"sluice train did not end in {timeout_s:g} s:\n{err.stdout}\n{err.stderr}")


def test_a_run_from_a_directory_holding_tasks_py_trains_and_imports_the_users_plugin(tmp_path):
    project = user_project(tmp_path)
    overrides = tiny_run_overrides(tmp_path, **{"reward.verifier": "my_verifier:verify"})
    result = sluice_train(project, *overrides, timeout_s=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "in place of Sluice" not in output
    assert "Done." in result.stdout
    # The plugin from the working directory scored the responses.
    assert (project / "calls.txt").read_text().count("called") > 0

    from sluice.infra.registry import CheckpointRegistry

    registry_uri = f"sqlite:///{tmp_path}/mlflow.db"
    names = _registered_models(registry_uri)
    assert len(names) == 1
    latest = CheckpointRegistry(registry_uri, names[0]).newest_servable()
    assert latest is not None and latest.policy_version == 3


def test_a_role_that_cannot_start_stops_the_run_with_one_line(tmp_path):
    project = user_project(tmp_path)
    overrides = tiny_run_overrides(tmp_path, **{"reward.verifier": "no_such_module:verify"})
    result = sluice_train(project, *overrides, timeout_s=240)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("sluice: error:")]
    assert len(errors) == 1, result.stderr[-4000:]
    line = errors[0]
    assert "the reward role cannot start" in line, line
    assert "no_such_module" in line, line
    assert "sluice train --resume" in line, line
    assert "Traceback" not in result.stdout + result.stderr
    # Stopped at once: the role was not retried (each retry would start it again).
    log = next((tmp_path / "work" / "runs").glob("*/logs/reward.log")).read_text()
    assert log.count("cannot start") == 1, log


def _registered_models(tracking_uri: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    return [m.name for m in MlflowClient(tracking_uri=tracking_uri).search_registered_models()]
