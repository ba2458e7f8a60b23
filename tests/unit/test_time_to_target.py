"""Time to target: which version counts as reaching it, and what the table says."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.flows.bench.async_vs_sync import with_settings
from sluice.flows.bench.time_to_target import (
    ScoredRun,
    Trial,
    curve_table,
    newest_at,
    reward_at,
    scaled_times,
    summary_table,
    time_to_target,
)

# Version k committed at 10 + 2k seconds (version 0 after 10 s of start-up).
TIMES = [(k, 10.0 + 2 * k) for k in range(60)]


class Scorer:
    """Held-out reward rising by 0.01 per version from 0.1; counts what was scored."""

    def __init__(self, slope: float = 0.01) -> None:
        self.slope = slope
        self.scored: list[int] = []

    def __call__(self, version: int) -> float:
        self.scored.append(version)
        return 0.1 + self.slope * version


def test_newest_at_is_the_last_version_committed_by_then() -> None:
    assert newest_at(TIMES, 5.0) is None
    assert newest_at(TIMES, 10.0) == 0
    assert newest_at(TIMES, 15.9) == 2
    assert newest_at(TIMES, 1e9) == 59


def test_time_to_target_bisects_between_grid_points_to_the_first_version() -> None:
    scorer = Scorer()
    # Target 0.3 is first reached by version 20, committed at 50 s; the grid sees
    # version 15 (40 s, below) then version 25 (60 s, above).
    got = time_to_target(TIMES, scorer, 0.3, grid=[0, 20, 40, 60, 80], refine_evals=4)
    assert got == pytest.approx(50.0)
    assert scorer.scored[:3] == [5, 15, 25]
    assert len(scorer.scored) <= 3 + 4


def test_time_to_target_with_no_refinement_is_the_grid_version() -> None:
    got = time_to_target(TIMES, Scorer(), 0.3, grid=[0, 20, 40, 60, 80], refine_evals=0)
    assert got == pytest.approx(60.0)


def test_time_to_target_is_none_when_never_reached_and_v0_counts_when_already_there() -> None:
    assert time_to_target(TIMES, Scorer(), 5.0, grid=[0, 60, 200]) is None
    assert time_to_target(TIMES, Scorer(), 0.05, grid=[0, 12, 60]) == pytest.approx(10.0)


def test_reward_at_scores_the_version_newest_at_that_time() -> None:
    assert reward_at(TIMES, Scorer(), 30.0) == pytest.approx(0.2)
    assert reward_at(TIMES, Scorer(), 1.0) is None


def _trial(label: str, seed: int, seconds: float | None) -> Trial:
    return Trial(
        label=label,
        seed=seed,
        run_id=f"{label}-{seed}",
        steps=100,
        v0_at_s=8.0,
        time_to_target_s=seconds,
        reward_at={"60": 0.3, "120": 0.4},
        trainer_idle_ratio=0.5,
        rollout_idle_ratio=None,
    )


def test_summary_table_divides_sync_time_by_each_contenders_time() -> None:
    trials = [
        _trial("sync", 0, 120.0),
        _trial("sync", 1, 140.0),
        _trial("async η=4", 0, 60.0),
        _trial("async η=4", 1, 70.0),
        _trial("async η=1", 0, 100.0),
        _trial("async η=1", 1, None),
    ]
    table = summary_table(trials, target=0.35, horizon_s=300, fixed_times=[60, 120, 300])
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "| 2.00 |" in rows["async η=4"]  # 130 / 65
    assert "| 1.00 |" in rows["sync"]
    # A contender that missed the target on a seed gets no ratio: its mean would flatter it.
    assert "1/2" in rows["async η=1"] and "> 300 for 1" in rows["async η=1"]
    assert "| - |" in rows["async η=1"]


def test_without_sync_the_first_contender_is_the_baseline_and_the_cost_is_shown() -> None:
    trials = [_trial("async η=config", s, t) for s, t in ((0, 90.0), (1, 110.0))]
    for seed, seconds, extra in ((0, 40.0, 1.5), (1, 60.0, 2.5)):
        trial = _trial("async η=config dynamic", seed, seconds)
        trial.extra_groups_per_batch = extra
        trials.append(trial)
    table = summary_table(trials, target=0.35, horizon_s=300, fixed_times=[60])
    assert "| async η=config time / time |" in table.splitlines()[0]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "| 2.00 |" in rows["async η=config dynamic"]  # 100 / 50
    assert rows["async η=config dynamic"].endswith("| 2.00 ± 0.71 |")
    assert rows["async η=config"].endswith("| - |")


def test_contenders_keeping_the_configs_eta_add_only_their_settings() -> None:
    from sluice.flows.bench.time_to_target import CONTENDERS, run_config
    from sluice.infra.config.run import load_config

    base = load_config(None, ["staleness.max_staleness=3"])
    by_label = {c.label: c for c in CONTENDERS}
    plain = run_config(base, by_label["async η=config"], "t", 1, 60.0)
    dynamic = run_config(base, by_label["async η=config dynamic"], "t", 1, 60.0)
    fixed = run_config(base, by_label["async η=1"], "t", 1, 60.0)
    assert (plain.staleness.max_staleness, dynamic.staleness.max_staleness) == (3, 3)
    assert fixed.staleness.max_staleness == 1
    assert not plain.trainer.dynamic_sampling and dynamic.trainer.dynamic_sampling
    assert plain.seed == dynamic.seed == 1 and plain.name != dynamic.name


def test_curve_table_averages_the_step_curves_of_the_seeds() -> None:
    a = _trial("sync", 0, 20.0)
    a.curve = [(5.0, 0, 0.1), (20.0, 10, 0.3)]
    b = _trial("sync", 1, 30.0)
    b.curve = [(5.0, 0, 0.1), (30.0, 15, 0.5)]
    table = curve_table([a, b], start=0.1, grid=[0, 20, 30])
    assert table.splitlines()[2] == "| sync | 0.100 | 0.200 | 0.400 |"


def test_a_longer_horizon_stretches_the_score_times_and_a_shorter_one_cuts_them() -> None:
    assert scaled_times([0, 60, 120, 300], 300) == [0, 60, 120, 300]
    assert scaled_times([0, 60, 120, 300], 900) == [0, 180, 360, 900]
    assert scaled_times([0, 60, 120, 300], 100) == [0, 60]


def test_a_scored_run_releases_every_checkpoint_and_marks_it_deleted(
    tmp_path: Path, tracking_uri: str
) -> None:
    from sluice.infra.checkpoints import save_checkpoint
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.paths import run_paths, run_registry
    from tests.unit.test_registry import make_hf_dir

    settings = {"tracking.uri": tracking_uri, "storage.url": f"file://{tmp_path}/store"}
    config = with_settings(load_config(None), settings)
    registry = run_registry(config, "ttt-release")
    # Under the run's own prefix: a run's registry reads no other source.
    paths = run_paths(config, "ttt-release")
    urls = [paths.checkpoint(v) for v in range(3)]
    for version, url in enumerate(urls):
        save_checkpoint(make_hf_dir(tmp_path / f"local{version}", version), url)
        registry.commit(version, url)
    scored = ScoredRun(config, "ttt-release", started_at=0.0)
    assert [v for v, _ in scored.version_times()] == [0, 1, 2]
    assert scored.release() == 3
    assert not any(Path(url.removeprefix("file://")).exists() for url in urls)
    assert all(v.deleted for v in registry.versions())
