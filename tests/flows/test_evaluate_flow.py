"""The `evaluate` flow under the Prefect harness against a real MLflow and real checkpoints.

Version 0 is committed the way the train flow does it (an MLflow run, then
`ensure_version_zero` with the tiny random model), so the test costs one evaluation of
a tiny model instead of a training run.
"""

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.tracking import get_client, get_metric_history, start_or_resume_run
from sluice.tasks.run.paths import registered_model_name
from sluice.tasks.run.prepare import ensure_version_zero
from tests.flows.conftest import flow_run_artifacts, flow_run_name_of, tiny_run_overrides

pytestmark = pytest.mark.flows

RUN_ID = "evaltest"


def test_evaluate_flow_logs_tags_and_reports_a_committed_version(prefect_api, tmp_path):
    from sluice.flows.evaluate import SUMMARY_ARTIFACT_KEY, TABLE_ARTIFACT_KEY, evaluate

    config = load_config("default", tiny_run_overrides(tmp_path))
    mlflow_run_id = start_or_resume_run(
        config.tracking.uri,
        config.tracking.experiment,
        run_name=RUN_ID,
        artifact_location=config.tracking.artifact_location,
    )
    ensure_version_zero(config, RUN_ID, mlflow_run_id)

    state = evaluate(config, run_id=RUN_ID, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["policy_version"] == 0
    assert result["mlflow_run_id"] == mlflow_run_id

    # MLflow: the held-out reward lands on the run that produced the version, at step 0.
    history = get_metric_history(config.tracking.uri, mlflow_run_id, "eval/reward")
    assert history == [(0, pytest.approx(result["eval/reward"]))]

    # Registry: the model version carries the same numbers, to 4 decimals.
    registry = CheckpointRegistry(config.tracking.uri, registered_model_name(config, RUN_ID))
    tags = registry.get(0).tags
    assert float(tags["sluice.eval.reward"]) == round(result["eval/reward"], 4)
    assert float(tags["sluice.eval.pass_at_1"]) == round(result["eval/pass_at_1"], 4)

    # Prefect: the flow run is named after the Sluice run, and carries a table and a
    # markdown summary.
    assert flow_run_name_of(state.state_details.flow_run_id) == RUN_ID
    artifacts = flow_run_artifacts(state.state_details.flow_run_id)
    kinds = {a.key: a.type for a in artifacts}
    assert kinds.get(TABLE_ARTIFACT_KEY) == "table"
    assert kinds.get(SUMMARY_ARTIFACT_KEY) == "markdown"


def test_evaluate_flow_opens_its_own_mlflow_run_for_a_version_without_one(prefect_api, tmp_path):
    from sluice.flows.evaluate import evaluate

    config = load_config("default", tiny_run_overrides(tmp_path))
    mlflow_run_id = start_or_resume_run(
        config.tracking.uri,
        config.tracking.experiment,
        run_name=RUN_ID,
        artifact_location=config.tracking.artifact_location,
    )
    zero = ensure_version_zero(config, RUN_ID, mlflow_run_id)
    # Same weights registered again without a producing run, as a hand-made commit would.
    registry = CheckpointRegistry(config.tracking.uri, registered_model_name(config, RUN_ID))
    registry.commit(1, zero["checkpoint_uri"], run_id=None)

    result = evaluate(config, run_id=RUN_ID, version=1)

    assert result["policy_version"] == 1
    assert result["mlflow_run_id"] != mlflow_run_id
    run = get_client(config.tracking.uri).get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == f"{RUN_ID}-eval-v1"
    history = get_metric_history(config.tracking.uri, result["mlflow_run_id"], "eval/reward")
    assert history == [(1, pytest.approx(result["eval/reward"]))]
    assert get_metric_history(config.tracking.uri, mlflow_run_id, "eval/reward") == []
