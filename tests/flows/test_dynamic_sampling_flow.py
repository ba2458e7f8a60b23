"""Dynamic sampling with refill in a real run: every trained batch holds B groups whose
rewards differ, the uninformative groups between them are dropped and counted as the
cost, the staleness bound holds, and a run where no group can ever be informative stops
with one line instead of generating forever."""

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.streams.reader import StreamReader
from sluice.infra.tracking import get_metric_history
from sluice.tasks.run.paths import registered_model_name
from tests.flows.conftest import tiny_run_overrides

pytestmark = pytest.mark.flows


def shipped_policy_run(tmp_path, **extra):
    """The tiny run on the shipped warm-started policy (about 30% correct, so groups
    of 4 are often mixed) instead of a random model (which scores 0 everywhere)."""
    overrides = [o for o in tiny_run_overrides(tmp_path) if not o.startswith("model.tiny.")]
    extra = {"rollout.group_size": 4, "rollout.max_new_tokens": 48, **extra}
    return load_config("default", [*overrides, *(f"{k}={v}" for k, v in extra.items())])


def test_refilled_batches_are_full_of_informative_groups_within_the_staleness_bound(
    prefect_api, tmp_path
):
    from sluice.flows.train import train

    config = shipped_policy_run(
        tmp_path, **{"model.shipped_policy": "true", "trainer.dynamic_sampling": "true"}
    )
    result = train(config, run_id="refill")
    uri, run = config.tracking.uri, result["mlflow_run_id"]
    B, steps = config.trainer.prompts_per_batch, config.trainer.total_steps

    def history(key):
        return [v for _, v in sorted(get_metric_history(uri, run, key))]

    assert history("reward/groups") == [B] * steps  # refilled, never shrunk
    assert history("reward/zero_variance_groups") == [0.0] * steps
    assert max(history("staleness/max")) <= config.staleness.max_staleness
    drawn, extra = (
        history("dynamic_sampling/drawn_groups"),
        history("dynamic_sampling/extra_groups"),
    )
    assert [d - e for d, e in zip(drawn, extra, strict=True)] == [B] * steps
    # Nothing lost or taken twice: the trainer acked every group it drew, no more.
    acked = StreamReader(config.storage.url, "refill", "scored", consumer="trainer").acked()
    assert len(acked) == sum(drawn)
    registry = CheckpointRegistry(uri, registered_model_name(config, "refill"))
    assert [v.policy_version for v in registry.versions()] == list(range(steps + 1))


def test_a_task_no_group_can_learn_from_stops_the_run_instead_of_generating_forever(
    prefect_api, tmp_path
):
    from sluice.flows.train import train
    from sluice.tasks.process.supervisor import WatchdogStopped

    # A random model scores 0 on every prompt: no group's rewards ever differ.
    config = load_config(
        "default",
        tiny_run_overrides(
            tmp_path,
            **{"trainer.dynamic_sampling": "true", "trainer.dynamic_sampling_max_draws": 2},
        ),
    )
    with pytest.raises(WatchdogStopped, match="batch 1 drew [0-9]+ groups and found fewer"):
        train(config, run_id="nosignal")
