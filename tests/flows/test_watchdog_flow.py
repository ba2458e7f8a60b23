"""The mismatch watchdog in a real run: an injected train–inference mismatch makes it
fire; `stop` ends the run at its last good version with one line, a Prefect event and an
MLflow metric; the run resumes, and `skip` then leaves the noisy batches out."""

import time

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.streams.reader import StreamReader
from sluice.infra.tracking import get_metric_history
from sluice.tasks.run.paths import registered_model_name
from tests.flows.conftest import tiny_run_overrides

pytestmark = pytest.mark.flows


def watchdog_events(run_id, wait_s=30.0):
    """The `sluice.watchdog.fired` events of `run_id` the harness's API stored (it
    persists events in the background, so they are waited for)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from sluice.flows.role_watch import WATCHDOG_EVENT

    deadline = time.monotonic() + wait_s
    while True:
        event_filter = EventFilter(  # its time window ends when it is made
            event=EventNameFilter(name=[WATCHDOG_EVENT]),
            resource=EventResourceFilter(id=[f"sluice.run.{run_id}"]),
        )
        with get_client(sync_client=True) as client:
            # The server answers at most 50 a page (the client's default asks for 100).
            events = client.read_events(filter=event_filter, limit=50).events
        if events or time.monotonic() > deadline:
            return events
        time.sleep(1.0)


def test_an_injected_mismatch_fires_the_watchdog_and_stop_leaves_a_resumable_run(
    prefect_api, tmp_path
):
    from sluice.flows.train import train
    from sluice.tasks.process.supervisor import WatchdogStopped

    noisy = tiny_run_overrides(
        tmp_path,
        **{
            "trainer.total_steps": 3,
            # The servers sample from perturbed weights; the trainer keeps clean ones.
            "rollout.weight_noise_std": 1.0,
            "trainer.watchdog.kl_k3.limit": 1e-3,
            "trainer.watchdog.kl_k3.limit_steps": 1,
            "trainer.watchdog.action": "stop",
        },
    )
    config = load_config("default", noisy)
    with pytest.raises(WatchdogStopped) as stopped:
        train(config, run_id="watched")
    line = str(stopped.value)
    assert "mismatch watchdog: kl_k3 fired at step 1" in line, line
    assert "last good version is 0" in line and "sluice train --resume watched" in line

    # Nothing of the noisy step was committed; its firing is on record.
    registry = CheckpointRegistry(config.tracking.uri, registered_model_name(config, "watched"))
    assert [v.policy_version for v in registry.versions()] == [0]
    mlflow_run = registry.get(0).run_id
    assert get_metric_history(config.tracking.uri, mlflow_run, "watchdog/kl_k3") == [(1, 1.0)]
    (event,) = watchdog_events("watched")
    assert event.payload["signal"] == "kl_k3" and event.payload["action"] == "stop"

    # Resumed with `skip`: every noisy batch is left out, nothing is lost, the run ends.
    resumed = load_config("default", [*noisy, "trainer.watchdog.action=skip"])
    result = train(resumed, run_id="watched", resume=True)
    assert result["final_policy_version"] == 3
    B = resumed.trainer.prompts_per_batch
    assert result["watchdog"]["by_signal"] == {"kl_k3": 3}
    assert result["watchdog"]["groups_skipped"] == 3 * B
    trainer = StreamReader(resumed.storage.url, "watched", "scored", consumer="trainer")
    assert len(trainer.acked()) == 3 * B
    for version in (1, 2, 3):
        assert registry.get(version).tags["watchdog.kl_k3"] == f"step {version} (skip)"
    applied = get_metric_history(resumed.tracking.uri, mlflow_run, "train/applied_minibatches")
    assert sorted({s for s, _ in applied}) == [1, 2, 3] and {v for _, v in applied} == {0.0}


def test_a_stop_makes_the_version_the_trainer_still_holds_durable(prefect_api, tmp_path):
    """With versions durable every 10, version 1 is servable only when step 2 fires a
    `stop` (two steps in a row over the limit): the refused step left the tensors at
    version 1, so the stop makes it durable and a resume goes on from it, not from 0."""
    from sluice.flows.train import train
    from sluice.tasks.process.supervisor import WatchdogStopped

    overrides = tiny_run_overrides(
        tmp_path,
        **{
            "trainer.total_steps": 3,
            "checkpoint.every_versions": 10,
            "rollout.weight_noise_std": 1.0,
            "trainer.watchdog.kl_k3.limit": 1e-3,
            "trainer.watchdog.kl_k3.limit_steps": 2,
            "trainer.watchdog.action": "stop",
        },
    )
    config = load_config("default", overrides)
    with pytest.raises(WatchdogStopped) as stopped:
        train(config, run_id="held")
    line = str(stopped.value)
    assert "kl_k3 fired at step 2" in line and "last good version is 1" in line, line

    registry = CheckpointRegistry(config.tracking.uri, registered_model_name(config, "held"))
    assert [v.policy_version for v in registry.versions()] == [0, 1]
    assert registry.get(1).tags["sluice.durable"] == "true"
    assert registry.newest_durable().policy_version == 1
    applied = get_metric_history(
        config.tracking.uri, registry.get(0).run_id, "train/applied_minibatches"
    )
    assert dict(applied)[1] > 0  # step 1 trained: version 1 is not version 0 again
