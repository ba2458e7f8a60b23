"""A lost trainer node is failed over at most `role_retries` times; past that the run
stops in one line that says what was lost and how to continue (exit code 75), and a
failover is recorded in the run's storage before the trainer is placed again. The
task state is Prefect's own Crashed state, as Ray's loss of a node leaves it."""

import uuid
from types import SimpleNamespace

import pytest
from prefect.states import Crashed

from sluice.flows.cluster import RayRoles, TrainerNodeLost
from sluice.infra.config.run import load_config
from sluice.tasks.process.supervisor import RunStopped
from sluice.tasks.run.failovers import read_failovers
from tests.flows.conftest import tiny_run_overrides

pytestmark = pytest.mark.flows


class Submitted(Exception):
    """Raised where the role would be submitted to Ray (no cluster in this test)."""


def roles(tmp_path, retries: int) -> RayRoles:
    config = load_config("default", tiny_run_overrides(tmp_path, role_retries=retries))
    placed = RayRoles(None, config, {"train": "t", "reward": "r"}, "run-1", "mlflow-1")
    placed.submit = lambda role: (_ for _ in ()).throw(Submitted(role))  # type: ignore[method-assign]
    return placed


def lost() -> tuple[SimpleNamespace, object]:
    return SimpleNamespace(task_run_id=uuid.uuid4()), Crashed(message="node 10.0.0.3 died")


def test_past_role_retries_a_lost_trainer_stops_the_run_resumably(prefect_api, tmp_path):
    placed = roles(tmp_path, retries=0)
    with pytest.raises(TrainerNodeLost) as stopped:
        placed.replace_lost("train", *lost())
    assert stopped.value.exit_code == 75
    line = str(stopped.value)
    assert "the node running the train role was lost (node 10.0.0.3 died), 1 time (" in line
    assert "role_retries=0" in line and "sluice train --resume run-1" in line
    assert read_failovers(placed.config, "run-1") == []  # nothing was failed over


def test_within_role_retries_a_lost_trainer_is_recorded_then_placed_again(prefect_api, tmp_path):
    placed = roles(tmp_path, retries=1)
    status = {"train": {"pid": 5, "started_at": 1.0, "step": 3}, "rollout": {}}
    with pytest.raises(Submitted):
        placed.replace_lost("train", *lost(), status)
    (failover,) = read_failovers(placed.config, "run-1")
    assert failover["role"] == "train" and failover["step_at_loss"] == 3
    assert failover["message"] == "node 10.0.0.3 died"
    assert placed.pending_failover == failover
    with pytest.raises(TrainerNodeLost):  # the second loss is past the bound
        placed.replace_lost("train", *lost(), status)


def test_other_roles_past_the_bound_stop_the_run_not_as_a_lost_trainer(prefect_api, tmp_path):
    placed = roles(tmp_path, retries=0)
    with pytest.raises(RunStopped) as stopped:
        placed.replace_lost("reward", *lost())
    assert not isinstance(stopped.value, TrainerNodeLost)
    assert "the reward role lost its node 1 time (role_retries=0)" in str(stopped.value)
