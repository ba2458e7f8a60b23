"""Servable before durable, under faults (docs/design.md §2): with a version durable every
4 steps, the trainer is killed between a served version and its durable write, then
between a durable write and its commit, then inside the update fence (copying a version
while the next step trains), and the rollout is killed while the newest version is not
durable; each is started again by hand. The versions served
since the newest durable one are lost, the groups holding their tokens are dropped and
issued again, and the books of the surviving lineage are clean (tasks/run/audit.py)."""

import json
import os

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.failpoints import ENV
from sluice.infra.tracking import start_or_resume_run
from sluice.tasks.run.audit import audit_run
from sluice.tasks.run.paths import run_paths, run_registry
from sluice.tasks.run.prepare import ensure_version_zero
from sluice.tasks.run.status import read_statuses
from tests.flows.conftest import tiny_run_overrides
from tests.integration.conftest import stop_process_group
from tests.integration.test_resume_after_kill import start as start_role
from tests.integration.test_resume_after_kill import wait_for

pytestmark = pytest.mark.integration
ROLES = ("rollout", "reward", "train")
STEPS = 12


def test_crashes_between_served_and_durable_retrain_from_the_durable_version_and_lose_nothing(
    tmp_path,
):
    run_id = "lineage"
    settings = {
        "trainer.total_steps": STEPS,
        "servers.weight_transfer": "shared_memory",
        "checkpoint.every_versions": 4,
        "evaluation.every": 0,
    }
    config = load_config("default", tiny_run_overrides(tmp_path, **settings))
    paths = run_paths(config, run_id)
    mlflow_run_id = start_or_resume_run(
        config.tracking.uri, config.tracking.experiment, run_name=run_id
    )
    ensure_version_zero(config, run_id, mlflow_run_id)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config.model_dump(mode="json")))
    plan = tmp_path / "failpoints.json"
    # The first durable write dies before it starts (v4 served, not durable); the next
    # one dies after its files are on storage, before the registry says durable; the
    # third trainer dies copying its first version while its next step trains.
    # One armed at a time, the next once the one before has fired.
    kills = ("train.offered_not_durable", "train.written_not_committed", "train.copying")
    plan.write_text(json.dumps({kills[0]: 1}))
    env = {**os.environ, ENV: str(plan)}
    log_dir = tmp_path / "logs"
    log_dir.mkdir()

    def start(role):
        return start_role(role, config_path, run_id, mlflow_run_id, log_dir, env)

    def step() -> int:
        return int(read_statuses(config, paths).get("train", {}).get("step", 0))

    procs = {role: start(role) for role in ROLES}
    started = list(procs.values())
    try:
        for index in range(len(kills)):
            assert procs["train"].wait(timeout=240) == -9, (log_dir / "train.log").read_text()
            record = json.loads(plan.read_text())
            fired = [f["name"] for f in record.get("fired", [])]
            assert fired == list(kills[: index + 1]), fired
            if index + 1 < len(kills):
                plan.write_text(json.dumps({**record, kills[index + 1]: 1}))
            procs["train"] = start("train")
            started.append(procs["train"])
        # The fourth trainer runs to the end; kill the rollout while it serves a version
        # that is not durable (every_versions=4: steps 1-3 of the lineage are not).
        registry = run_registry(config, run_id)

        def serving_pending() -> bool:
            served = registry.newest_servable()
            return served is not None and served.incarnation == 4 and not served.durable

        wait_for(serving_pending, 240, "the fourth trainer serving a version not yet durable")
        procs["rollout"].kill()
        procs["rollout"].wait()
        procs["rollout"] = start("rollout")
        started.append(procs["rollout"])
        for role, proc in procs.items():
            assert proc.wait(timeout=300) == 0, (log_dir / f"{role}.log").read_text()[-3000:]
    finally:
        for proc in started:
            stop_process_group(proc, grace_s=5)

    audit = audit_run(config, run_id)
    assert audit.problems() == []
    assert audit.versions == list(range(STEPS + 1))
    assert audit.durable_versions[-1] == STEPS and 4 in audit.durable_versions
    # The first two dead trainers' versions were served and lost (the third died before
    # it registered one); the surviving lineage is the fourth's.
    lost = {name.split("/")[0] for name in audit.lost_versions}
    assert lost == {"r1", "r2"}, audit.lost_versions
    assert audit.duplicated == 0 and audit.groups_lost == [] and audit.groups_extra == []
    assert audit.trained_lost_tokens == []
    # The groups written with tokens of lost versions, counted (and issued again).
    assert read_statuses(config, paths)["rollout"]["groups_lineage_dropped"] > 0
    train_log = (log_dir / "train.log").read_text()
    assert "were served, not durable" in train_log and "(at most (N + eta) x B = " in train_log
    assert step() == STEPS
