"""`sluice train multiturn` end to end under the Prefect harness: a warm-started tiny
policy learns to call the calculator, its episodes reach the trainer with their
observations masked, and the run's metrics say so."""

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.streams.reader import StreamReader
from sluice.infra.tracking import get_metric_history
from tests.conftest import local_run_settings

pytestmark = pytest.mark.flows


def test_the_multiturn_run_learns_to_call_its_tool(prefect_api, tmp_path):
    from sluice.flows.train import train

    settings = [f"{k}={v}" for k, v in local_run_settings(tmp_path).items()]
    config = load_config("multiturn", [*settings, "trainer.total_steps=30"])
    result = train(config, run_id="mt")
    uri, run = config.tracking.uri, result["mlflow_run_id"]

    reward = get_metric_history(uri, run, "eval/reward")
    calling = get_metric_history(uri, run, "eval/calling_fraction")
    assert reward[0][0] == 0 and reward[-1][0] == 30
    assert reward[-1][1] - reward[0][1] >= 0.2, reward
    assert calling[-1][1] - calling[0][1] >= 0.15, calling
    assert [v for _, v in get_metric_history(uri, run, "episode/turns_mean")]
    assert get_metric_history(uri, run, "staleness/turn_mean")

    scored = StreamReader(config.storage.url, "mt", "scored", consumer="test")
    refs = scored.poll()
    assert refs
    table = scored.read(refs[0])
    for mask, ids, logprobs, calls in zip(
        table.column("loss_mask").to_pylist(),
        table.column("response_token_ids").to_pylist(),
        table.column("behaviour_logprobs").to_pylist(),
        table.column("tool_calls").to_pylist(),
        strict=True,
    ):
        assert len(mask) == len(ids) == len(logprobs)
        assert calls > 0 or 0 not in mask  # an observation only where a call was answered
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
