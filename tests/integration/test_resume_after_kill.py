"""Kill a role with SIGKILL mid-run, start it again, and check the run's books:
no shard lost or consumed twice, versions contiguous, staleness bound kept."""

import json
import signal
import subprocess
import time
from collections import Counter

import pytest

from sluice.engines.rl.groups import group_index_of
from sluice.infra.config import load_config
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.streams.reader import StreamReader
from sluice.infra.tracking import start_or_resume_run
from sluice.tasks.process.supervisor import role_command
from sluice.tasks.run.paths import registered_model_name, run_paths
from sluice.tasks.run.prepare import ensure_version_zero
from sluice.tasks.run.status import read_statuses
from sluice.tasks.run.versions import read_consumed
from tests.flows.conftest import tiny_run_overrides
from tests.integration.conftest import stop_process_group

pytestmark = pytest.mark.integration
ROLES = ("rollout", "reward", "train")


def start(role, config_path, run_id, mlflow_run_id, log_dir):
    """A role as its own process group (what it starts goes with it at the end)."""
    with open(log_dir / f"{role}.log", "ab") as log:
        return subprocess.Popen(
            role_command(role, str(config_path), run_id, mlflow_run_id),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("victim", ROLES)
def test_sigkill_and_restart_of_a_role_loses_nothing_and_trains_nothing_twice(tmp_path, victim):
    run_id = f"kill-{victim}"
    config = load_config("default", tiny_run_overrides(tmp_path, **{"trainer.total_steps": 5}))
    paths = run_paths(config, run_id)
    mlflow_run_id = start_or_resume_run(
        config.tracking.uri, config.tracking.experiment, run_name=run_id
    )
    ensure_version_zero(config, run_id, mlflow_run_id)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config.model_dump(mode="json")))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()

    procs = {}
    started = []  # every process, the killed one included: its children may live on
    try:
        for role in ROLES:
            procs[role] = start(role, config_path, run_id, mlflow_run_id, log_dir)
            started.append(procs[role])
        wait_for(
            lambda: read_statuses(config, paths).get("train", {}).get("step", 0) >= 2,
            240,
            "two training steps",
        )
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        procs[victim] = start(victim, config_path, run_id, mlflow_run_id, log_dir)
        started.append(procs[victim])
        for role, proc in procs.items():
            assert proc.wait(timeout=300) == 0, (log_dir / f"{role}.log").read_text()[-3000:]
    finally:
        for proc in started:
            stop_process_group(proc, grace_s=5)

    registry = CheckpointRegistry(config.tracking.uri, registered_model_name(config, run_id))
    versions = registry.versions()
    assert [v.policy_version for v in versions] == list(range(6))

    # Every group reached each stream once (the rollout/reward restarts re-did their work
    # under the same keys).
    def groups_of(stream):
        reader = StreamReader(config.storage.url, run_id, stream, consumer="audit")
        return Counter(
            g for ref in reader.committed() for g in reader.read(ref).column("group_id").to_pylist()
        )

    for stream in ("rollouts", "scored"):
        counts = groups_of(stream)
        assert all(c == config.rollout.group_size for c in counts.values()), (stream, counts)

    # Each trained shard went into exactly one version, and the trainer's ledger agrees.
    trainer = StreamReader(config.storage.url, run_id, "scored", consumer="trainer")
    consumed_by_version = {v.policy_version: read_consumed(config, paths, v) for v in versions[1:]}
    every = [name for names in consumed_by_version.values() for name in names]
    assert len(every) == len(set(every)) == 5 * config.trainer.prompts_per_batch
    assert set(every) == trainer.acked()

    # Staleness bound: a batch trained into version v was generated at >= v - 1 - eta.
    scored = StreamReader(config.storage.url, run_id, "scored", consumer="audit2")
    by_name = {ref.name: ref for ref in scored.committed()}
    B = config.trainer.prompts_per_batch
    for version, names in consumed_by_version.items():
        indices: set[int] = set()
        for name in names:
            table = scored.read(by_name[name])
            starts = table.column("version_start").to_pylist()
            assert min(starts) >= version - 1 - config.staleness.max_staleness
            indices.update(group_index_of(g) for g in table.column("group_id").to_pylist())
        # Version v trained exactly the groups issued as numbers (v-1)B .. vB-1.
        assert indices == set(range((version - 1) * B, version * B))
