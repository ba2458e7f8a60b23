"""Run one long-lived role in its own OS process, under a Prefect task.

Each role (rollout, reward, train, evaluate) is a loop in a child process, so
generation and training really overlap on CPU instead of sharing one GIL. The child
is forked from a launcher that has the roles' imports done (tasks/launch.py). The
Prefect task around it owns the lifecycle: it starts the child, forwards a stop,
and turns a non-zero exit into a task failure that Prefect retries; a retried role
resumes from its ledger and the registry, which is what makes "kill any task at any
moment" survivable.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.launch import start_role


class RoleFailed(RuntimeError):
    """A role process exited with an error."""


def role_command(role: str, config_path: str, run_id: str, mlflow_run_id: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tasks.worker",
        role,
        "--config",
        config_path,
        "--run-id",
        run_id,
        "--mlflow-run-id",
        mlflow_run_id,
    ]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def supervise_role(
    role: str,
    config_path: str,
    run_id: str,
    mlflow_run_id: str,
    log_dir: str,
    stop_grace_s: float = 20.0,
) -> int:
    """Start the role process, wait for it, and fail loudly if it fails."""
    log_path = Path(log_dir) / f"{role}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = role_command(role, config_path, run_id, mlflow_run_id)
    child = start_role(command[3:], log_path, command)
    try:
        while child.poll() is None:
            time.sleep(0.5)
    finally:
        if child.poll() is None:  # the flow is going away: let the role flush
            child.stop(stop_grace_s)
    code = child.poll()
    if code != 0:
        raise RoleFailed(
            f"{role} process exited with code {code}; last lines of {log_path}:\n{_tail(log_path)}"
        )
    return 0


@task(
    name="run-role", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, persist_result=False
)
def run_role(role: str, config_path: str, run_id: str, mlflow_run_id: str, log_dir: str) -> int:
    """One long-lived role as a Prefect task; retried roles resume from ledgers and the registry."""
    get_run_logger().info("starting %s (log: %s/%s.log)", role, log_dir, role)
    return supervise_role(role, config_path, run_id, mlflow_run_id, log_dir)
