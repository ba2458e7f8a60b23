"""Versions named by (incarnation r, step k), servable before durable, against a real
MLflow sqlite store (docs/design.md §2: servable is not durable)."""

from __future__ import annotations

import ast
import os
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from sluice.infra.checkpoints import (  # noqa: E402
    CheckpointIncomplete,
    save_checkpoint,
    verify_checkpoint,
)
from sluice.infra.policy_version import TAG_DURABLE, TAG_INCARNATION  # noqa: E402
from sluice.infra.registry import CheckpointRegistry, PolicyVersionConflict  # noqa: E402

from .test_registry import committed_checkpoint as _checkpoint  # noqa: E402
from .test_registry import make_hf_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def registry(tracking_uri: str) -> CheckpointRegistry:
    return CheckpointRegistry(tracking_uri, f"lineage-{uuid.uuid4().hex[:8]}")


def committed_checkpoint(tmp_path: Path, k: int, seed: int) -> str:
    """A checkpoint of step `k` in a folder of its own (incarnations do not share one)."""
    folder = tmp_path / f"s{seed}"
    folder.mkdir(exist_ok=True)
    return _checkpoint(folder, k, seed=seed)


def publish(registry, tmp_path, k, r=1, durable=False):
    uri = committed_checkpoint(tmp_path, k, seed=1000 * r + k)
    return registry.commit(k, uri, incarnation=r, durable=durable)


def test_a_pending_version_is_servable_and_not_durable(registry, tmp_path):
    registry.commit(0, committed_checkpoint(tmp_path, 0, seed=7))
    pending = publish(registry, tmp_path, 1)
    assert pending.tags[TAG_DURABLE] == "pending" and pending.tags[TAG_INCARNATION] == "1"
    assert registry.newest_servable().identity == (1, 1)
    assert registry.newest_durable().identity == (0, 0)
    made = registry.mark_durable(1, incarnation=1)
    assert made.durable
    assert registry.newest_durable().identity == (1, 1)
    assert registry.aliased_versions() == {"newest": 1, "newest-durable": 1}


def test_a_durable_alias_never_moves_back_onto_an_older_durable_version(registry, tmp_path):
    publish(registry, tmp_path, 1)
    publish(registry, tmp_path, 2)
    registry.mark_durable(2, incarnation=1)
    registry.mark_durable(1, incarnation=1)  # its durability landed late
    assert registry.newest_durable().identity == (1, 2)


def test_skipped_versions_stay_servable_and_never_become_the_durable_one(registry, tmp_path):
    registry.commit(0, committed_checkpoint(tmp_path, 0, seed=7))
    uri = committed_checkpoint(tmp_path, 1, seed=1001)
    registry.commit(1, uri, incarnation=1, durable=False, pending=False)
    assert registry.get(1).durability == "skipped"
    assert registry.newest_servable().policy_version == 1
    assert registry.newest_durable().policy_version == 0


def test_a_new_incarnation_outranks_higher_steps_of_the_old_one(registry, tmp_path):
    registry.commit(0, committed_checkpoint(tmp_path, 0, seed=7))
    publish(registry, tmp_path, 1, durable=True)
    for k in (2, 3, 4):
        publish(registry, tmp_path, k)
    durable = registry.sync_alias()
    assert durable.identity == (1, 1)

    lost = registry.reset_lineage(durable)

    assert [v.identity for v in lost] == [(1, 2), (1, 3), (1, 4)]
    assert all(registry.get(k, incarnation=1).lost for k in (2, 3, 4))
    # The servable alias goes back to the durable version: nothing serves lost weights.
    assert registry.newest_servable().identity == (1, 1)
    assert registry.next_incarnation() == 2
    # Step 2 again, under incarnation 2: other weights, and newer than (1, 4).
    again = publish(registry, tmp_path, 2, r=2)
    assert registry.newest_servable().identity == (2, 2)
    assert again.identity > (1, 4)
    # Step 2 of the surviving lineage is incarnation 2's; the lost one is still listed.
    assert registry.get(2).incarnation == 2
    assert [v.identity for v in registry.versions()] == [
        (0, 0), (1, 1), (1, 2), (1, 3), (1, 4), (2, 2)
    ]  # fmt: skip


def test_a_lost_version_cannot_be_published_again_or_made_durable(registry, tmp_path):
    durable = publish(registry, tmp_path, 1, durable=True)
    uri = committed_checkpoint(tmp_path, 2, seed=1002)
    registry.commit(2, uri, incarnation=1, durable=False)
    registry.reset_lineage(durable)
    with pytest.raises(PolicyVersionConflict, match="marked lost"):
        registry.mark_durable(2, incarnation=1)
    with pytest.raises(PolicyVersionConflict, match="marked lost"):
        registry.commit(2, uri, incarnation=1, durable=True)


def test_an_old_incarnation_cannot_publish_after_a_new_one(registry, tmp_path):
    """A zombie trainer (lease lost, still running) publishing its next step is refused."""
    publish(registry, tmp_path, 5, r=2)
    with pytest.raises(PolicyVersionConflict, match="only move forward"):
        publish(registry, tmp_path, 9, r=1)
    assert registry.newest_servable().identity == (2, 5)


def test_reset_lineage_refuses_a_version_that_is_not_the_newest_durable_one(registry, tmp_path):
    first = publish(registry, tmp_path, 1, durable=True)
    pending = publish(registry, tmp_path, 2)
    with pytest.raises(ValueError, match="not durable"):
        registry.reset_lineage(pending)
    publish(registry, tmp_path, 3, durable=True)
    with pytest.raises(PolicyVersionConflict, match="resume from the newest durable"):
        registry.reset_lineage(first)


def test_a_durable_retry_of_a_pending_version_marks_it_durable(registry, tmp_path):
    uri = committed_checkpoint(tmp_path, 1, seed=1)
    registry.commit(1, uri, incarnation=1, durable=False)
    again = registry.commit(1, uri, incarnation=1, durable=True)
    assert again.durable and registry.newest_durable().identity == (1, 1)
    assert len(registry.versions()) == 1


# ---------------------------------------------------------------- who reads which alias

SERVABLE_READERS = {
    # The staleness gate: the rollout reloads when the servable alias moves.
    ("tasks/rollout/role.py", "maybe_update_weights"),
    # Whether a version a reader could not fetch was overtaken (it then takes the newest).
    ("tasks/run/versions.py", "superseded"),
    # Bookkeeping that fetches no bytes: the run id and mode tag a measurement reads.
    ("flows/planner/measurements.py", "measure_run"),
    # The audit checks where both aliases point.
    ("tasks/run/audit.py", "audit_run"),
}
BOTH = {("tasks/run/audit.py", "audit_run")}
"""Every production caller of `newest_servable()`. Everything else that asks for "the
newest version" fetches bytes from storage (a cold server, the reward role's tokenizer,
evaluation, promotion, reports, resume) and must read `newest_durable()`."""


def _callers(method: str) -> set[tuple[str, str]]:
    found = set()
    for folder in ("engines", "infra", "tasks", "flows"):
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for func in ast.walk(tree):
                if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(func):
                    name = node.attr if isinstance(node, ast.Attribute) else None
                    if name == method:
                        found.add((str(path.relative_to(REPO)), func.name))
    return {c for c in found if c[0] != "infra/registry.py"}


def test_every_reader_of_the_newest_version_is_listed_with_the_alias_it_means():
    servable = _callers("newest_servable")
    durable = _callers("newest_durable")
    assert servable == SERVABLE_READERS
    assert len(durable) >= 10, sorted(durable)
    assert servable & durable == BOTH, "a function reads both: say which it means"


def test_a_version_served_before_its_files_exist_gets_its_digest_once_durable(registry, tmp_path):
    url = str(tmp_path / "storage" / "v000001")  # where its durable checkpoint will land
    pending = registry.commit(1, url, incarnation=1, durable=False)
    assert pending.checkpoint_digest is None and registry.newest_servable().identity == (1, 1)
    with pytest.raises(CheckpointIncomplete):  # nothing on storage yet
        registry.mark_durable(1, incarnation=1)
    assert registry.newest_durable() is None

    save_checkpoint(make_hf_dir(tmp_path / "written", 3), url)
    made = registry.mark_durable(1, incarnation=1)

    assert made.checkpoint_digest == verify_checkpoint(url).digest
    assert registry.newest_durable().checkpoint_digest == made.checkpoint_digest
