"""Run one long-lived role in its own OS process, under a Prefect task.

Each role (rollout, reward, train, evaluate) is a loop in a child process, so
generation and training really overlap on CPU instead of sharing one GIL. The child
is forked from a launcher that has the roles' imports done (tasks/process/launcher.py). The
Prefect task around it owns the lifecycle: it starts the child, forwards a stop,
and turns a non-zero exit into a task failure that Prefect retries; a retried role
resumes from its ledger and the registry, which is what makes "kill any task at any
moment" survivable.

A role that exits because the object store or the tracking server stopped answering
(`EXIT_OUTAGE`, infra/outages.py) is not retried into the outage: its supervisor
probes both services and starts it again once they answer, which costs none of the
role's retries. An outage longer than `outage_timeout_s` ends the task with
`ServiceOutage`, one line naming the service and how to continue (`--resume`), which
Prefect does not retry.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from sluice.infra.config.run import RunConfig
from sluice.infra.outages import EXIT_OUTAGE, probe_storage, probe_tracking
from sluice.infra.secrets import redact_text, redact_uri, write_private_json
from sluice.tasks.process.launcher import PYTHON, close_launcher, start_role
from sluice.tasks.process.ray_ranks import RAY_ADDRESS_ENV, TRAIN_GROUP_ENV, node_address
from sluice.tasks.process.ray_servers import NODE_ADDRESS_ENV
from sluice.tasks.role import (
    CANNOT_START_MARK,
    DAMAGED_MARK,
    EXIT_CANNOT_START,
    EXIT_DAMAGED,
    EXIT_WATCHDOG,
    OUTAGE_MARK,
    WATCHDOG_MARK,
)
from sluice.tasks.run.credential import write_run_token

Logger = logging.Logger | logging.LoggerAdapter[Any]

OUTAGE_PROBE_INTERVAL_S = (2.0, 30.0)
"""First and longest pause between two probes of a service that does not answer."""


class RoleFailed(RuntimeError):
    """A role process exited with an error."""


class RunStopped(RuntimeError):
    """A role met what no restart can cure; the run stops with this one-line message."""

    exit_code = 1
    """What `sluice train` exits with."""


class ServiceOutage(RunStopped):
    """The object store or the tracking server did not answer for longer than the run
    waits (`outage_timeout_s`): the run stops, to be continued with `--resume`."""

    exit_code = EXIT_OUTAGE


class RoleCannotStart(RunStopped):
    """A role process failed before its loop began (its imports, its config, a plugin
    that does not load): a restart would fail the same way, so the run stops at once."""

    exit_code = EXIT_CANNOT_START


class CheckpointDamaged(RunStopped):
    """A committed checkpoint the run needs lost a file or had one altered after its
    commit (outside Sluice): the run stops until it is restored."""

    exit_code = EXIT_DAMAGED


class WatchdogStopped(RunStopped):
    """The mismatch watchdog fired with action `stop` (`trainer.watchdog`): the run
    stops at its last good version, to be continued with `--resume`."""

    exit_code = EXIT_WATCHDOG


class StopWithoutTraceback(logging.Filter):
    """Drop the traceback Prefect logs with a task or flow that ended in `RunStopped`.

    Its message says what stopped and how to continue; the traceback through Prefect's
    engine and this supervisor says nothing more and buries that line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], RunStopped):
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_run_stopped_tracebacks() -> None:
    """Install `StopWithoutTraceback` on Prefect's task-run and flow-run loggers."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, StopWithoutTraceback) for f in logger.filters):
            logger.addFilter(StopWithoutTraceback())


def may_retry(_task: object, _task_run: object, state: object) -> bool:
    """Prefect's retry condition for role tasks: everything but `RunStopped` (an outage
    that outlasted the wait, a damaged checkpoint: a retry would only meet it again)."""
    return not isinstance(getattr(state, "data", None), RunStopped)


# ---------------------------------------------------------------- stopping every role

_stopping: set[str] = set()
_stopping_lock = threading.Lock()


def stop_roles(run_id: str) -> None:
    """Tell every role of `run_id` supervised in this process to stop (SIGTERM: flush
    and exit), and any supervisor waiting out an outage to give up.

    The run's `done` marker says the same through storage; this reaches the roles when
    storage is what failed.
    """
    with _stopping_lock:
        _stopping.add(run_id)


def roles_stopping(run_id: str) -> bool:
    with _stopping_lock:
        return run_id in _stopping


def forget_stop(run_id: str) -> None:
    """Clear a stop of `run_id` (a flow resuming it in this process starts fresh)."""
    with _stopping_lock:
        _stopping.discard(run_id)


# ---------------------------------------------------------------- one role


WORKER_MODULE = "sluice.tasks.process.worker"


def role_args(role: str, config_path: str, run_id: str, mlflow_run_id: str) -> list[str]:
    """The worker's arguments for one role (what the launcher forks with)."""
    return [
        role,
        "--config",
        config_path,
        "--run-id",
        run_id,
        "--mlflow-run-id",
        mlflow_run_id,
    ]


def role_command(role: str, config_path: str, run_id: str, mlflow_run_id: str) -> list[str]:
    """The same role in a fresh interpreter."""
    return [*PYTHON, "-m", WORKER_MODULE, *role_args(role, config_path, run_id, mlflow_run_id)]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _marked_line(log_path: Path, mark: str) -> str:
    """The end of the last line of the role's log that holds `mark` (from the mark on)."""
    lines = _tail(log_path, 40).splitlines()
    found = [line[line.index(mark) :] for line in lines if mark in line]
    return (found or lines or ["(no log)"])[-1].strip()


def _run_once(args: list[str], log_path: Path, run_id: str, stop_grace_s: float) -> int | None:
    """Start the role process and wait for it; its exit code (None: told to stop)."""
    child = start_role(args, log_path, [*PYTHON, "-m", WORKER_MODULE, *args])
    try:
        while child.poll() is None:
            if roles_stopping(run_id):
                child.stop(stop_grace_s)
                return None
            time.sleep(0.5)
    finally:
        if child.poll() is None:  # the flow is going away: let the role flush
            child.stop(stop_grace_s)
    return child.poll()


def how_to_continue(role: str, run_id: str) -> str:
    """The end of a `RunStopped` line: resume the run (the colocated baseline cannot)."""
    if role == "sync":
        return "start the synchronous run again"
    return f"continue with: sluice train --resume {run_id}"


def unanswered_services(config: RunConfig, probe_timeout_s: float = 10.0) -> dict[str, str]:
    """The run's services that do not answer now, each with why: `{"the object store
    s3://...": "ReadTimeoutError: ..."}`; empty when both answer."""
    down = {}
    why = probe_storage(config.storage.url, config.storage.options, probe_timeout_s)
    if why is not None:
        down[f"the object store {redact_uri(config.storage.url)}"] = redact_text(why)
    why = probe_tracking(config.tracking.uri, probe_timeout_s)
    if why is not None:
        down[f"the tracking server {redact_uri(config.tracking.uri)}"] = redact_text(why)
    return down


def wait_for_services(config: RunConfig, role: str, run_id: str, since: float, log: Logger) -> bool:
    """Probe the services with growing pauses until both answer (True), the run is told
    to stop (False), or `config.outage_timeout_s` has passed since `since` (raises
    `ServiceOutage` naming what did not answer)."""
    pause, longest = OUTAGE_PROBE_INTERVAL_S
    deadline = since + config.outage_timeout_s
    while True:
        if roles_stopping(run_id):
            return False
        down = unanswered_services(config)
        if not down:
            return True
        waited = time.monotonic() - since
        if time.monotonic() >= deadline:
            services = " and ".join(f"{name} ({why})" for name, why in down.items())
            raise ServiceOutage(
                f"run {run_id} stopped: {services} did not answer for {waited:.0f} s "
                f"(outage_timeout_s={config.outage_timeout_s:g}; the {role} role cannot go "
                f"on without it). Everything committed is kept; once it answers again, "
                f"{how_to_continue(role, run_id)}"
            )
        log.warning("%s waits for %s (%.0f s so far)", role, ", ".join(down), waited)
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(longest, pause * 2)


def supervise_role(
    role: str,
    config_path: str,
    run_id: str,
    mlflow_run_id: str,
    log_dir: str,
    stop_grace_s: float = 20.0,
    log: Logger | None = None,
) -> int:
    """Start the role process and keep it running through outages; fail loudly if it fails.

    Outage exits come in streaks (a restarted role may fail again at once while a
    service flaps); the wait is counted from the streak's first exit, and a streak
    ends when a restarted role has run for `outage_timeout_s` before failing again.
    """
    log = log or logging.getLogger("sluice")
    config = RunConfig.model_validate(json.loads(Path(config_path).read_text()))
    log_path = Path(log_dir) / f"{role}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    args = role_args(role, config_path, run_id, mlflow_run_id)
    streak_started: float | None = None
    while True:
        started = time.monotonic()
        code = _run_once(args, log_path, run_id, stop_grace_s)
        if code is None or code == 0:
            return 0
        if code == EXIT_DAMAGED:
            raise CheckpointDamaged(
                f"run {run_id} stopped: {_marked_line(log_path, DAMAGED_MARK)}. It changed "
                f"after its commit (deleted or overwritten outside Sluice); restore it, then "
                f"{how_to_continue(role, run_id)}"
            )
        if code == EXIT_CANNOT_START:
            raise RoleCannotStart(
                f"run {run_id} stopped: the {role} role "
                f"{_marked_line(log_path, CANNOT_START_MARK)} (log: {log_path}). Fix that, "
                f"then {how_to_continue(role, run_id)}"
            )
        if code == EXIT_WATCHDOG:
            raise WatchdogStopped(
                f"run {run_id} stopped by the {_marked_line(log_path, WATCHDOG_MARK)}. See "
                f"its signal in MLflow (watchdog/*), then {how_to_continue(role, run_id)}"
            )
        if code != EXIT_OUTAGE:
            raise RoleFailed(
                f"{role} process exited with code {code}; last lines of {log_path}:\n"
                f"{_tail(log_path)}"
            )
        ended = time.monotonic()
        if streak_started is None or ended - started >= config.outage_timeout_s:
            streak_started = ended
        log.warning("%s stopped on an outage: %s", role, _marked_line(log_path, OUTAGE_MARK))
        if not wait_for_services(config, role, run_id, streak_started, log):
            return 0
        log.info("%s: the services answer again; starting it again", role)


ROLE_TASK = {
    "retries": 2,
    "retry_delay_seconds": 2,
    "retry_condition_fn": may_retry,
    "cache_policy": NO_CACHE,
    "persist_result": False,
}
"""Prefect task settings of a role's task, on this machine or on a Ray node."""


@task(name="run-role", **ROLE_TASK)
def run_role(role: str, config_path: str, run_id: str, mlflow_run_id: str, log_dir: str) -> int:
    """One long-lived role as a Prefect task; retried roles resume from ledgers and the registry."""
    logger = get_run_logger()
    logger.info("starting %s (log: %s/%s.log)", role, log_dir, role)
    return supervise_role(role, config_path, run_id, mlflow_run_id, log_dir, log=logger)


@task(name="run-role-on-node", **ROLE_TASK)
def run_role_on_node(
    role: str,
    config_json: dict[str, Any],
    run_id: str,
    mlflow_run_id: str,
    train_group: str | None = None,
    run_token: str | None = None,
) -> int:
    """One long-lived role as a Prefect task on a Ray node (`cluster.engine: ray`).

    The node may share no disk with the flow's machine, so the task is handed the
    resolved config itself and writes it under the node's workdir, where the role's
    log goes too. The role's process is forked from a launcher this worker starts;
    closing it at the end lets a reused Ray worker start the next run's roles fresh,
    and a worker that dies (its node lost) takes the launcher's roles with it. A split
    trainer's role is told the cluster and the placement group reserved for its ranks
    (`train_group`; tasks/process/ray_ranks.py), a rollout role the cluster (its
    inference servers are actors, tasks/process/ray_servers.py). `run_token`, the flow's
    credential, is written to this node's 0600 file for the role to read; the role's
    listeners bind the address the node registered with Ray.
    """
    logger = get_run_logger()
    config = RunConfig.model_validate(config_json)
    if train_group or (role == "rollout" and config.servers.launch == "ray"):
        import ray  # the role's process joins the cluster: rank actors, server actors

        os.environ[RAY_ADDRESS_ENV] = ray.get_runtime_context().gcs_address
    if train_group:
        os.environ[TRAIN_GROUP_ENV] = train_group
    if config.servers.launch == "ray":
        os.environ[NODE_ADDRESS_ENV] = node_address()
    if run_token is not None:
        write_run_token(config, run_id, run_token)
    local = Path(config.workdir) / "runs" / run_id
    config_path = local / "config.json"
    local.mkdir(parents=True, exist_ok=True)
    # Roles sharing a node (or a shared file system) write the same file: whole or not at
    # all, and 0600: it holds the run's credentials.
    write_private_json(config_path, config_json)
    log_dir = str(local / "logs")
    logger.info("starting %s on %s (log: %s/%s.log)", role, socket.gethostname(), log_dir, role)
    try:
        return supervise_role(role, str(config_path), run_id, mlflow_run_id, log_dir, log=logger)
    finally:
        close_launcher()
        # A reused worker starts clean.
        for name in (RAY_ADDRESS_ENV, TRAIN_GROUP_ENV, NODE_ADDRESS_ENV):
            os.environ.pop(name, None)
