"""`sluice train` with each weight path (`servers.weight_transfer`): real role processes,
the embedded server in its own process, the registry gating every version. Each run must
deliver every version over its path (no fall-back to disk), serve each one's bytes, and
leave a clean audit: every token version a trained sample carries is a durable version."""

import pytest

from sluice.infra.config import load_config
from sluice.tasks.run.audit import audit_run
from sluice.tasks.run.paths import run_paths
from sluice.tasks.run.status import read_statuses
from tests.flows.conftest import tiny_run_overrides

pytestmark = pytest.mark.flows


@pytest.mark.parametrize("path", ["disk", "distributed", "shared_memory"])
def test_train_delivers_every_version_over_its_weight_path_and_audits_clean(
    prefect_api, tmp_path, path
):
    from sluice.flows.train import train

    run_id = f"wt-{path.replace('_', '-')}"
    overrides = tiny_run_overrides(
        tmp_path,
        **{
            "servers.weight_transfer": path,
            "trainer.total_steps": 4,
            "evaluation.during_run": "false",
            "rollout.poll_interval_s": 0.1,
        },
    )
    config = load_config("default", overrides)
    state = train(config, run_id=run_id, return_state=True)
    assert state.is_completed(), state.message

    rollout = read_statuses(config, run_paths(config, run_id))["rollout"]
    assert rollout["weight_path"] == path
    assert rollout["weight_fallbacks"] == 0
    assert rollout["weight_updates"] >= 1
    if path == "disk":
        assert rollout["weight_bytes_moved"] == 0
    else:  # every update came over the path: a version's float32 weights each time
        assert rollout["weight_bytes_moved"] > 0
        assert rollout["weight_bytes_moved"] % rollout["weight_updates"] == 0

    audit = audit_run(config, run_id)
    assert audit.problems() == [], audit.problems()
    assert audit.versions[-1] == 4
    assert audit.max_staleness <= config.staleness.max_staleness
