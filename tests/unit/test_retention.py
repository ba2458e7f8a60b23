"""Retention of published versions (tasks/run/retention.py), on real files and a real
sqlite MLflow: after each commit the newest `storage.keep_versions` versions, those an
alias or a `sluice.keep` tag pins and those the evaluation schedule has yet to score
keep their checkpoints; the others are tagged deleted, then deleted. The newest two
trainer states stay. A failed delete is a warning, retried after the next commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from sluice.infra.config.run import RunConfig
from sluice.tasks.run.versions import SavedVersion, read_consumed


@pytest.fixture
def config(local_run_config: Callable[..., RunConfig], tmp_path: Path) -> RunConfig:
    return local_run_config(
        tmp_path,
        "storage.keep_versions=2",
        "evaluation.every=3",
        "trainer.total_steps=10",
    )


@pytest.fixture
def role(config):
    from sluice.tasks.train.role import TrainRole

    return TrainRole(config, "run", mlflow_run_id="")


def saved(tmp_path: Path, version: int) -> SavedVersion:
    """A small stand-in for what the trainer saves: policy files and trainer state."""
    local = SavedVersion(tmp_path / f"v{version}" / "policy", tmp_path / f"v{version}" / "state")
    local.policy.mkdir(parents=True)
    local.trainer_state.mkdir(parents=True)
    (local.policy / "config.json").write_text("{}")
    (local.policy / "model.safetensors").write_bytes(bytes([version]) * 64)
    (local.trainer_state / "optimizer.pt").write_bytes(bytes([version]) * 128)
    (local.trainer_state / "trainer_state.json").write_text(f'{{"steps_done": {version}}}')
    return local


def publish(role, tmp_path: Path, version: int) -> None:
    role.commit_version(saved(tmp_path, version), version, {}, consumed=[f"shard-{version}"])


def on_storage(config: RunConfig, folder: str = "") -> set[str]:
    root = Path(config.storage.url.removeprefix("file://")) / "run" / "checkpoints" / folder
    return {p.name for p in root.iterdir() if p.name.startswith("v")}


def deleted_tags(role) -> set[int]:
    return {v.policy_version for v in role.registry.versions() if v.deleted}


def test_retention_keeps_newest_pinned_and_unevaluated_versions_and_deletes_the_rest(
    config, role, tmp_path
):
    registry = role.registry
    for version in range(7):
        publish(role, tmp_path, version)
        if version == 0:
            registry.set_tag(0, "eval.reward", "0.1")  # scored: nothing holds it any more
        if version == 2:
            registry.set_tag(2, "sluice.keep", "true")
        if version == 1:
            registry._client.set_registered_model_alias(
                registry.model_name, "champion", str(registry.get(1).model_version)
            )

    # Newest 2: 5, 6. Alias: 1. Tag: 2. Awaiting evaluation (every 3rd, newer than the
    # newest scored, 0): 3 and 6. Let go: 0 and 4.
    assert on_storage(config) == {f"v{v:06d}" for v in (1, 2, 3, 5, 6)}
    assert deleted_tags(role) == {0, 4}
    assert on_storage(config, "trainer_state") == {"v000005", "v000006"}
    # The consumed lists are the run's exactly-once record: every version keeps its own.
    assert [read_consumed(config, role.paths, v) for v in registry.versions()] == [
        [f"shard-{v}"] for v in range(7)
    ]

    registry.set_tag(3, "eval.reward", "0.2")  # version 3 scored: 3 goes, and with it 5
    publish(role, tmp_path, 7)
    assert on_storage(config) == {f"v{v:06d}" for v in (1, 2, 6, 7)}
    assert deleted_tags(role) == {0, 3, 4, 5}
    assert role.retention.deleted == [0, 4, 3, 5]


def test_the_version_a_run_restarted_from_stays_while_newer_ones_come_and_go(
    config, role, tmp_path
):
    from sluice.tasks.run.control import write_start

    publish(role, tmp_path, 0)
    role.registry.set_tag(0, "eval.reward", "0.1")
    publish(role, tmp_path, 1)
    # The run restarts from version 1: a launched server container that dies is started
    # again on version 1's weights, so retention must leave them.
    write_start(config, "run", 1, role.registry.get(1).checkpoint_uri)
    for version in range(2, 6):
        publish(role, tmp_path, version)
    # Newest 2: 4, 5. Awaiting evaluation: 3. The start: 1. Let go: 0, 2.
    assert on_storage(config) == {f"v{v:06d}" for v in (1, 3, 4, 5)}
    assert deleted_tags(role) == {0, 2}


def test_keep_versions_zero_keeps_every_policy_but_only_the_newest_two_trainer_states(
    local_run_config, tmp_path
):
    from sluice.tasks.train.role import TrainRole

    config = local_run_config(tmp_path, "storage.keep_versions=0")
    role = TrainRole(config, "run", mlflow_run_id="")
    for version in range(4):
        publish(role, tmp_path, version)
    assert on_storage(config) == {f"v{v:06d}" for v in range(4)}
    assert on_storage(config, "trainer_state") == {"v000002", "v000003"}
    assert deleted_tags(role) == set()


def test_a_failed_delete_never_stops_publishing_and_is_retried_after_the_next_commit(
    config, role, tmp_path, monkeypatch, caplog
):
    from sluice.tasks.run import retention

    real = retention.delete_checkpoint
    failures: list[str] = []

    def refused(url, options=None):
        if "/checkpoints/v" in url:  # the policy folders; trainer states go as usual
            failures.append(url)
            raise PermissionError(13, "Access Denied", url)
        return real(url, options)

    for version in range(3):
        publish(role, tmp_path, version)
    registry = role.registry
    registry.set_tag(0, "eval.reward", "0.1")

    monkeypatch.setattr(retention, "delete_checkpoint", refused)
    with caplog.at_level(logging.WARNING, logger="sluice.retention"):
        publish(role, tmp_path, 3)  # lets 0 and 1 go: storage refuses both
    assert registry.newest_servable().policy_version == 3  # committed all the same
    assert len(failures) == 2 and "cannot delete policy version 0" in caplog.text
    assert deleted_tags(role) == {0, 1}  # marked first: no reader picks them any more
    assert {"v000000", "v000001"} <= on_storage(config)
    assert on_storage(config, "trainer_state") == {"v000002", "v000003"}

    monkeypatch.setattr(retention, "delete_checkpoint", real)
    publish(role, tmp_path, 4)  # retries 0 and 1, lets 2 go
    assert on_storage(config) == {"v000003", "v000004"}
    assert deleted_tags(role) == {0, 1, 2}
    assert registry.newest_servable().policy_version == 4


def test_the_evaluate_role_never_meets_a_version_retention_let_go(
    local_run_config, tmp_path, tiny_dir
):
    from sluice.infra.checkpoints import delete_checkpoint, save_checkpoint
    from sluice.infra.tracking import get_metric_history, start_or_resume_run
    from sluice.tasks.evaluate.role import EvaluateRole
    from sluice.tasks.run.paths import read_json

    config = local_run_config(
        tmp_path,
        "trainer.total_steps=3",
        "evaluation.every=1",
        "evaluation.num_prompts=2",
        "evaluation.greedy=false",
        "rollout.max_new_tokens=4",
    )
    mlflow_run = start_or_resume_run(config.tracking.uri, "evaluate", run_name="run")
    role = EvaluateRole(config, "run", mlflow_run_id=mlflow_run)
    for v in range(4):
        role.registry.commit(v, save_checkpoint(tiny_dir, role.paths.checkpoint(v)))
    role.registry.set_tag(0, "eval.reward", "0.0")  # scored before a restart
    role.registry.mark_deleted(1)
    delete_checkpoint(role.paths.checkpoint(1))
    role.control.mark_done("trained")

    role.run()

    steps = get_metric_history(config.tracking.uri, mlflow_run, "eval/reward")
    assert [step for step, _ in steps] == [2, 3]
    status = read_json(config, role.paths.status("evaluate"))
    assert "versions_unreadable" not in status  # it never tried version 1


def test_what_an_attempt_left_before_its_commit_is_replaced_by_the_retrained_version(
    role, tmp_path
):
    from sluice.infra.checkpoints import read_manifest, save_checkpoint

    publish(role, tmp_path, 0)
    # A trainer died after uploading version 1, before committing it; the retrain differs.
    dead = saved(tmp_path / "dead", 1)
    (dead.policy / "model.safetensors").write_bytes(b"\xff" * 64)
    (dead.trainer_state / "optimizer.pt").write_bytes(b"\xff" * 128)
    save_checkpoint(dead.policy, role.paths.checkpoint(1))
    save_checkpoint(dead.trainer_state, role.paths.trainer_state(1))

    publish(role, tmp_path, 1)

    committed = role.registry.get(1)
    assert committed.checkpoint_digest == read_manifest(committed.checkpoint_uri).digest
    state = Path(role.paths.trainer_state(1).removeprefix("file://")) / "optimizer.pt"
    assert state.read_bytes() == bytes([1]) * 128
