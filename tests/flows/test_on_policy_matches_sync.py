"""At eta = 0 the asynchronous run does the synchronous run's work: `mode: on_policy`
and `sluice train --sync` on one seed log the same metrics and publish the same weights,
bit for bit on a CPU, at every step.

What makes the work the same (docs/design.md §1: eta = 0 is synchronous training): group
n samples with the same seeds in both (`engines/rl/groups.sample_seed`), the rollout role
sends a batch's groups as one request, which its server queues as one arrival
(`Scheduler.submit_many`), so the server's engine batches the B x G responses as the
sync loop's in-process engine does, and the trainer takes a batch in (group, sample)
order. Each of those, undone, moves the numbers (loss/policy_loss in the 7th digit when
the rows batched together differ: the behaviour log-probs' last bits change); a failure
here names the metrics that differ, step by step.
"""

import json

import pytest

from sluice.infra.config.run import load_config
from sluice.tasks.run.metrics_file import metrics_file
from sluice.tasks.run.paths import run_registry
from tests.flows.conftest import tiny_run_overrides

pytestmark = [pytest.mark.flows, pytest.mark.slow]  # ~22 s: two 3-step runs

STEPS = 3
COMPARED = ("grad/", "is/", "loss/", "mismatch/", "policy/", "response/", "reward/", "train/")
"""Metric families that depend only on the work done (what the sync loop logs of them)."""
TIMED = ("_s", "_per_s", "idle_ratio")
"""Clock readings in those families, which differ by nature."""


def step_metrics(config, run_id):
    """Per step, the compared metrics the run logged (its `metrics.jsonl`)."""
    lines = [json.loads(line) for line in metrics_file(config, run_id).read_text().splitlines()]
    return {
        line["step"]: {
            key: value
            for key, value in line.items()
            if key.startswith(COMPARED) and not key.endswith(TIMED)
        }
        for line in lines
    }


def test_on_policy_logs_and_publishes_what_the_sync_loop_does_bit_for_bit(
    prefect_api, tmp_path, graded_verifier
):
    from sluice.flows.train import train
    from sluice.flows.train_sync import train_sync

    overrides = tiny_run_overrides(
        tmp_path,
        **{
            "mode": "on_policy",
            "staleness.max_staleness": 0,  # tiny_run_overrides sets 1; the mode means 0
            "reward.verifier": graded_verifier,
            "rollout.group_size": 4,
            "trainer.total_steps": STEPS,
            "threads_per_role": 1,  # the thread count splits float reductions: pin it
            "evaluation.during_run": "false",
            "storage.keep_versions": 0,  # every version's digest stays to compare
        },
    )
    config = load_config("default", overrides)
    assert config.staleness.max_staleness == 0 and config.trainer.publish_every == 1

    train_sync(config, run_id="sync")
    train(config, run_id="on-policy")

    sync, on_policy = step_metrics(config, "sync"), step_metrics(config, "on-policy")
    assert sorted(sync) == sorted(on_policy) == list(range(1, STEPS + 1))
    for step in sync:
        assert len(sync[step]) >= 40, sorted(sync[step])
        same_keys = {key: on_policy[step].get(key) for key in sync[step]}
        assert same_keys == sync[step], f"step {step}"
    # Not vacuous: a graded reward gives the loss something to carry.
    assert any(sync[step]["loss/policy_loss"] != 0.0 for step in sync)

    registries = run_registry(config, "sync"), run_registry(config, "on-policy")
    for version in range(STEPS + 1):
        ours, theirs = (registry.get(version) for registry in registries)
        assert ours is not None and theirs is not None, version
        assert ours.checkpoint_digest is not None
        assert theirs.checkpoint_digest == ours.checkpoint_digest, f"version {version}"
