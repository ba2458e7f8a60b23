"""Where the gradient comes from, and held-out reward per problem size."""

import numpy as np
import pytest

from sluice.engines.rl.evaluation import reward_by_size
from sluice.engines.rl.samples import gradient_sources


def test_gradient_sources_tell_mixed_groups_from_all_wrong_and_all_right_ones():
    # Groups: 0 all right, 1 all wrong, 2 mixed (one right, one wrong), 3 all wrong.
    rewards = np.array([1, 1, 0, 0, 1, 0, 0, 0], dtype=float)
    groups = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    advantages = np.array([0, 0, 0, 0, 1, -1, 0, 0], dtype=float)
    got = gradient_sources(rewards, groups, advantages)
    assert got == {
        "grad/mixed_groups": 1.0,
        "grad/all_wrong_groups": 2.0,
        "grad/all_right_groups": 1.0,
        "grad/positive_samples": 1.0,
        "grad/negative_samples": 1.0,
    }


def test_a_batch_where_every_group_failed_has_no_all_right_group():
    got = gradient_sources(np.zeros(4), np.array([0, 0, 1, 1]), np.zeros(4))
    assert got["grad/all_wrong_groups"] == 2.0
    assert got["grad/all_right_groups"] == 0.0
    assert got["grad/mixed_groups"] == 0.0


def test_held_out_reward_is_split_by_problem_size():
    rows = [{"num_terms": 2}, {"num_terms": 4}, {"num_terms": 3}, {"num_terms": 20}]
    # Two samples per prompt, in prompt order.
    rewards = [1, 1, 0, 1, 1, 1, 0, 0]
    got = reward_by_size(rows, rewards, 2)
    assert got == {
        "eval/reward_terms_2": 1.0,
        # sizes 3 and 4: samples (0, 1) and (1, 1) -> 3 of 4
        "eval/reward_terms_3-4": pytest.approx(0.75),
        "eval/reward_terms_17_up": 0.0,
    }


def test_rows_without_a_size_get_no_size_split():
    assert reward_by_size([{"prompt": "x"}], [1.0], 1) == {}


def test_every_new_metric_name_is_one_mlflow_accepts(tmp_path, tracking_uri):
    from sluice.infra.tracking import get_metric_history, log_metrics, start_or_resume_run

    uri = tracking_uri
    run = start_or_resume_run(uri, "names", "r", artifact_location=str(tmp_path / "a"))
    rows = [{"num_terms": n} for n in (2, 3, 5, 9, 17)]
    metrics = {
        **reward_by_size(rows, [1.0] * 5, 1),
        **gradient_sources(np.ones(2), np.array([0, 0]), np.zeros(2)),
    }
    assert log_metrics(uri, run, metrics, step=0) == len(metrics)
    assert get_metric_history(uri, run, "eval/reward_terms_17_up") == [(0, 1.0)]
