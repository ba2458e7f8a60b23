"""The run's record of trainer failovers (tasks/run/failovers.py): written to the run's
storage when the flow places a lost trainer again, its recovery noted only once a new
trainer process has trained past the lost one's step, and summarised against the
registry's commit times."""

import pytest

from sluice.tasks.run.failovers import (
    failover_summary,
    note_recovery,
    read_failovers,
    record_loss,
)
from sluice.tasks.run.report import failover_lines


@pytest.fixture
def config(tmp_path, local_run_config):
    return local_run_config(tmp_path)


def statuses(pid, started_at, step, samples):
    return {
        "train": {"pid": pid, "started_at": started_at, "step": step},
        "rollout": {"samples_written": samples, "tokens_generated": 10 * samples},
    }


def test_a_failover_is_recorded_and_its_recovery_noted_only_for_a_new_trainer_past_its_step(
    config,
):
    assert read_failovers(config, "r") == []
    pending = record_loss(config, "r", "train", "node lost", statuses(7, 100.0, 4, 64))
    (stored,) = read_failovers(config, "r")
    assert stored == pending
    assert stored["step_at_loss"] == 4 and stored["recovered_at"] is None
    assert stored["rollout_at_loss"]["samples_written"] == 64

    # The lost trainer's own last report, and a new one still on the resumed version:
    assert not note_recovery(config, "r", pending, statuses(7, 100.0, 5, 70))
    assert not note_recovery(config, "r", pending, statuses(9, 200.0, 4, 80))
    # Same pid number on another node (a container) is a new process too:
    assert note_recovery(config, "r", pending, statuses(7, 200.0, 5, 96))
    (done,) = read_failovers(config, "r")
    assert done["recovered_at"] >= done["lost_at"]
    assert done["step_at_recovery"] == 5
    assert done["rollout_at_recovery"]["samples_written"] == 96


def test_the_summary_counts_seconds_to_the_next_commit_and_samples_generated_meanwhile():
    failovers = [
        {
            "role": "train",
            "lost_at": 1000.0,
            "recovered_at": 1050.0,
            "rollout_at_loss": {"samples_written": 64},
            "rollout_at_recovery": {"samples_written": 96},
        },
        {  # the rollout role restarted meanwhile: its count began again
            "role": "train",
            "lost_at": 2000.0,
            "recovered_at": None,
            "rollout_at_loss": {"samples_written": 200},
            "rollout_at_recovery": {"samples_written": 8},
        },
    ]
    # Commits at 990 (before the first loss), 1062 and 1070; none after 2000.
    rows = failover_summary(failovers, [990.0, 1062.0, 1070.0])
    assert rows == [
        {
            "role": "train",
            "to_next_commit_s": 62.0,  # 1062 - 1000
            "to_first_step_s": 50.0,  # 1050 - 1000
            "samples_generated_meanwhile": 32,  # 96 - 64
        },
        {
            "role": "train",
            "to_next_commit_s": None,
            "to_first_step_s": None,
            "samples_generated_meanwhile": None,
        },
    ]
    (line,) = failover_lines(rows)
    assert line.startswith("- trainer failovers: 2 (next version committed 62 s after the loss,")
    assert "32 samples generated meanwhile" in line and "committed - after" in line
    assert failover_lines([]) == []
