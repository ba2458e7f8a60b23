"""`sluice train` with each weight path (`servers.weight_transfer`): real role processes,
the embedded server in its own process, the registry gating every version. Each run must
deliver every version over its path (no fall-back to disk), serve each one's bytes, and
leave a clean audit: every token version a trained sample carries is a durable version.
Every route it used asked for the run's credential, which was left in nothing the run
wrote but its own 0600 file: no log line, no MLflow param, no Prefect flow-run
parameter, no file on storage."""

import asyncio
import json
from pathlib import Path

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.tracking import get_client
from sluice.tasks.run.audit import audit_run
from sluice.tasks.run.credential import token_path
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

    mlflow_run_id = state.result()["mlflow_run_id"]
    assert_token_kept(config, run_id, tmp_path, mlflow_run_id, state.state_details.flow_run_id)


def assert_token_kept(config, run_id: str, root: Path, mlflow_run_id: str, flow_run_id) -> None:
    """The run's token is in its 0600 file and nowhere else the run wrote or reported."""
    path = token_path(config, run_id)
    assert (path.stat().st_mode & 0o777) == 0o600
    token = path.read_text().strip().encode()
    assert len(token) >= 40
    # Logs, streams, checkpoints, control documents, the MLflow store and its artifacts.
    leaks = [
        str(f) for f in root.rglob("*") if f.is_file() and f != path and token in f.read_bytes()
    ]
    assert leaks == []
    params = get_client(config.tracking.uri).get_run(mlflow_run_id).data.params
    assert params  # the resolved config was logged: there was something to leak into
    assert token.decode() not in json.dumps(params)
    assert token.decode() not in json.dumps(_flow_run_parameters(flow_run_id), default=str)


def _flow_run_parameters(flow_run_id) -> dict:
    from prefect.client.orchestration import get_client

    async def read() -> dict:
        async with get_client() as client:
            return (await client.read_flow_run(flow_run_id)).parameters

    return asyncio.run(read())
