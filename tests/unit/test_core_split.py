"""The run summary's core split: threads per role and what the idle ratios say."""

from __future__ import annotations

from sluice.tasks.run.report import core_split_lines, suggest_split


def test_core_split_lines_name_threads_idle_ratios_and_the_suggested_split() -> None:
    lines = core_split_lines(
        {
            "cores": 8,
            "threads": {"rollout": 4, "train": 4},
            "trainer_idle": 0.4,
            "rollout_idle": 0.02,
            "train_compute_s_per_step": 0.3,
            "wall_s_per_step": 0.6,
            "suggested": {"rollout": 5, "train": 3},
        }
    )
    text = "\n".join(lines)
    assert "cores: 8; torch threads: rollout 4, train 4" in text
    assert "0.60 s of wall time, 0.30 s of it training compute" in text
    assert "trainer idle 40% (waiting for data), rollout idle 2%" in text
    assert "rollout 5 / train 3 threads" in text


def test_core_split_lines_for_the_sync_baseline_have_no_rollout_idle() -> None:
    lines = core_split_lines(
        {"cores": 2, "threads": {"sync": 2}, "trainer_idle": 0.5, "rollout_idle": None}
    )
    assert lines == ["- cores: 2; torch threads: sync 2", "- trainer idle 50% (waiting for data)"]


def test_suggested_split_follows_busy_time_and_leaves_each_side_a_core() -> None:
    # Trainer busy 30% of the time, rollout busy all the time: generation gets more.
    assert suggest_split(8, trainer_idle=0.7, rollout_idle=0.0) == {"rollout": 6, "train": 2}
    assert suggest_split(8, trainer_idle=0.0, rollout_idle=0.0) == {"rollout": 4, "train": 4}
    assert suggest_split(2, trainer_idle=0.9, rollout_idle=0.0) == {"rollout": 1, "train": 1}
    assert suggest_split(4, trainer_idle=0.0, rollout_idle=1.0) == {"rollout": 1, "train": 3}
