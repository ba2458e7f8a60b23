"""bench_recipe's curve summary and settings: hand-made curves, numbers worked out in comments."""

import argparse

import pytest

from sluice.infra.config.overrides import ConfigError
from tests.benchmarks.bench_recipe import RecipeRun, build_config, report_text, runs_table
from tests.unit.test_adapter_versions import published  # noqa: F401, F811 (a fixture)


def run(seed: int, curve: list[tuple[float, int, float]], budget_s: float = 600.0) -> RecipeRun:
    return RecipeRun(seed, f"r{seed}", budget_s, curve=curve, step_time_s=20.0)


# Budget 600 s: the last third starts at 400 s. v9 came after the budget.
HELD = run(0, [(5, 0, 0.10), (200, 3, 0.30), (420, 6, 0.28), (590, 8, 0.32), (640, 9, 0.05)])
FELL = run(1, [(5, 0, 0.10), (200, 3, 0.40), (420, 6, 0.20), (590, 8, 0.26)])


def test_final_is_the_newest_version_within_the_budget_and_hold_the_last_third_mean():
    assert HELD.start == 0.10
    assert HELD.steps == 8 and HELD.final == 0.32  # v9 (0.05) came after the budget
    assert HELD.peak == 0.32
    assert HELD.hold == pytest.approx((0.28 + 0.32) / 2)  # v6 and v8 (at >= 400 s)
    assert HELD.gain(HELD.final) == pytest.approx(0.22)


def test_a_gain_that_fell_back_does_not_hold_even_with_a_good_final():
    # FELL: peak +0.30 at v3, final +0.16, but the last third's mean is +0.13.
    assert FELL.gain(FELL.final) == pytest.approx(0.16)
    assert FELL.gain(FELL.hold) == pytest.approx(0.13)
    assert not FELL.holds(0.15)
    assert HELD.holds(0.15)
    assert not HELD.holds(0.25)  # final +0.22


def test_a_run_with_no_version_in_the_last_third_has_no_hold():
    early = run(2, [(5, 0, 0.1), (100, 1, 0.5)])
    assert early.hold is None and not early.holds(0.15)


def test_after_a_supervised_pass_gains_count_from_the_model_before_it():
    # Version 0 (0.30) is the passed model; the model given was at 0.10 (`before`).
    passed = RecipeRun(4, "r4", 600.0, curve=[(300, 0, 0.30), (420, 2, 0.26), (590, 4, 0.28)])
    assert passed.start == 0.30 and passed.gain(passed.final) == pytest.approx(-0.02)
    passed.before = 0.10
    assert passed.start == 0.10 and passed.peak == 0.30
    assert passed.gain(passed.final) == pytest.approx(0.18)  # 0.28 - 0.10
    assert passed.gain(passed.hold) == pytest.approx(0.17)  # (0.26 + 0.28) / 2 - 0.10
    assert passed.holds(0.15) and not passed.holds(0.18)


def test_the_report_lists_each_run_and_counts_the_seeds_that_hold():
    broken = RecipeRun(3, "r3", 600.0, error="RuntimeError: boom")
    text = report_text([HELD, FELL, broken], 0.15)
    assert "(after the budget)" in text  # v9 is shown but marked
    assert "failed: RuntimeError: boom" in text
    last = runs_table([HELD, FELL], 0.15).splitlines()[-1]
    assert last.startswith("| mean ± std | 8.0 ± 0.0")
    assert last.endswith("| 1 of 2 |")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seeds": 0}, "--seeds must be >= 1"),
        ({"every": 0}, "--every must be >= 1"),
        ({"overrides": ["evaluation.every=3"]}, "bench_recipe sets evaluation.every itself"),
        ({"model_path": "/nonexistent"}, "not a Hugging Face model directory"),
        # The shipped recipe's 24-minute pass and a 2-minute run: one line, at load.
        ({"minutes": 2.0}, "leaves RL none of trainer.time_budget_s=120"),
    ],
)
def test_bad_arguments_fail_in_one_line(tmp_path, change, message):
    (tmp_path / "config.json").write_text("{}")
    args = dict(
        model_path=str(tmp_path),
        config="reasoning_gym_mix",
        seeds=1,
        minutes=1.0,
        every=5,
        overrides=[],
    )
    args.update(change)
    with pytest.raises(ConfigError, match=message):
        build_config(argparse.Namespace(**args))


def test_scoring_is_greedy_on_the_shipped_mix(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = argparse.Namespace(
        model_path=str(tmp_path),
        config="reasoning_gym_mix",
        seeds=1,
        minutes=30.0,
        every=4,
        overrides=[],
    )
    config, scoring = build_config(args)
    assert config.trainer.time_budget_s == 1800 and config.evaluation.every == 4
    assert config.model.supervised.minutes == 24  # the shipped recipe's pass comes along
    assert not config.evaluation.during_run
    assert scoring.evaluation.temperature == 0 and scoring.seed == 0
    tasks = config.problem.reasoning_gym.tasks
    assert tasks["chain_sum"].settings["max_terms"] == 4


def test_a_lora_runs_adapters_are_scored_before_their_base_is_deleted(published, tmp_path):  # noqa: F811
    # Version 1 is an adapter over version 0; scoring v0 first and deleting it at once
    # would leave v1 nothing to merge onto (the failure this ordering fixes).
    from sluice.infra.checkpoints import CheckpointIncomplete, read_manifest
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.paths import run_registry
    from tests.benchmarks.bench_recipe import score_run

    _config, base_uri, adapter_uri, _model = published
    config = load_config(
        "default",
        [
            f"workdir={tmp_path}/work",
            f"storage.url=file://{tmp_path}/store",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            "trainer.lora.rank=4",
            "evaluation.num_prompts=4",
            "evaluation.temperature=0",
        ],
    )
    registry = run_registry(config, "lora-run")
    registry.commit(0, base_uri)
    registry.commit(1, adapter_uri)

    scored = RecipeRun(0, "lora-run", 600.0)
    score_run(config, scored, started_at=0.0)

    assert [version for _, version, _ in scored.curve] == [0, 1]
    assert all(0.0 <= accuracy <= 1.0 for _, _, accuracy in scored.curve)
    assert all(version.deleted for version in registry.versions())
    for uri in (base_uri, adapter_uri):
        with pytest.raises(CheckpointIncomplete):
            read_manifest(uri)
