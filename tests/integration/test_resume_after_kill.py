"""Kill each role with SIGKILL mid-run, one after another in one run, start it again by
hand (no supervisor), and check the run's books (tasks/run/audit.py): no shard lost or
consumed twice, every group whole in each stream, versions contiguous, the trainer's
ledger equal to what the versions trained, staleness bound kept."""

import json
import subprocess
import time

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.tracking import start_or_resume_run
from sluice.tasks.process.supervisor import role_command
from sluice.tasks.run.audit import audit_run
from sluice.tasks.run.paths import run_paths
from sluice.tasks.run.prepare import ensure_version_zero
from sluice.tasks.run.status import read_statuses
from tests.flows.conftest import tiny_run_overrides
from tests.integration.conftest import stop_process_group

pytestmark = pytest.mark.integration
ROLES = ("rollout", "reward", "train")
STEPS = 20
KILLS = ("rollout", "reward", "train")
"""The roles killed, in turn, a second apart, once the trainer has made two steps: all
three land early in the run. Waiting for a step between kills does not work: a role's
status document can move several steps at once on a loaded box, and a run of 10 steps
once finished before its last kill that way; with kills two seconds apart, a 10-step run
once finished before its second."""


def start(role, config_path, run_id, mlflow_run_id, log_dir, env=None):
    """A role as its own process group (what it starts goes with it at the end)."""
    with open(log_dir / f"{role}.log", "ab") as log:
        return subprocess.Popen(
            role_command(role, str(config_path), run_id, mlflow_run_id),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("weight_transfer", ["shared_memory", "distributed"])
def test_sigkill_and_restart_of_each_role_loses_nothing_and_trains_nothing_twice(
    tmp_path, weight_transfer
):
    """With each fast weight path: the killed trainer takes its sender (and the weight
    group's rank 0) with it, the killed rollout its server; versions after the restarts
    go over the path again, and no version is served before it is durable."""
    run_id = "kill-each"
    settings = {"trainer.total_steps": STEPS, "servers.weight_transfer": weight_transfer}
    config = load_config("default", tiny_run_overrides(tmp_path, **settings))
    paths = run_paths(config, run_id)
    mlflow_run_id = start_or_resume_run(
        config.tracking.uri, config.tracking.experiment, run_name=run_id
    )
    ensure_version_zero(config, run_id, mlflow_run_id)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config.model_dump(mode="json")))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()

    def step() -> int:
        return int(read_statuses(config, paths).get("train", {}).get("step", 0))

    procs = {}
    started = []  # every process, the killed ones included: their children may live on
    try:
        for role in ROLES:
            procs[role] = start(role, config_path, run_id, mlflow_run_id, log_dir)
            started.append(procs[role])
        wait_for(lambda: step() >= 2, 240, "two training steps")
        for victim in KILLS:
            assert step() < STEPS and procs[victim].poll() is None, (
                f"{victim} ended before its kill"
            )
            procs[victim].kill()
            procs[victim].wait()
            procs[victim] = start(victim, config_path, run_id, mlflow_run_id, log_dir)
            started.append(procs[victim])
            time.sleep(1)
        for role, proc in procs.items():
            assert proc.wait(timeout=300) == 0, (log_dir / f"{role}.log").read_text()[-3000:]
    finally:
        for proc in started:
            stop_process_group(proc, grace_s=5)

    audit = audit_run(config, run_id)
    assert audit.problems() == []
    assert audit.versions == list(range(STEPS + 1))
    rollout = read_statuses(config, paths)["rollout"]
    assert rollout["weight_path"] == weight_transfer
    # the restarted rollout took later versions over the path, not only from disk
    assert rollout["weight_bytes_moved"] > 0, rollout
