"""bench_proximal's tables and settings: hand-made rows, numbers worked out in comments."""

import argparse
import math

import pytest

from sluice.infra.config.overrides import ConfigError
from tests.benchmarks.bench_proximal import (
    ArmRun,
    arm_order,
    arm_stats,
    build_config,
    mean_through,
    newest_within,
    payload,
    ratio_table,
    report_text,
    seed_ratios,
    seed_table,
    summary_table,
)


def row(arm, seed, position, steps, step_s, prox_s, pass_tokens, kl, final, **more) -> ArmRun:
    return ArmRun(
        arm,
        seed,
        f"{arm[0]}{seed}",
        position,
        steps=steps,
        step_time_s=step_s,
        proximal_time_s=prox_s,
        proximal_pass_tokens=pass_tokens,
        kl_k3=kl,
        held_out_start=0.2,
        held_out_final=final,
        **more,
    )


def two_seeds() -> list[ArmRun]:
    # seed 0: exact first; seed 1: loglinear first. Held-out start 0.2 everywhere.
    return [
        row("exact", 0, 1, 10, 20.0, 2.0, 800.0, 1e-3, 0.5, steps_total=12),
        row("loglinear", 0, 2, 12, 16.0, 0.0, 0.0, 2e-3, 0.45, response_tokens=900.0),
        row("loglinear", 1, 1, 14, 18.0, 0.0, 0.0, 4e-3, 0.55, response_tokens=1100.0),
        row("exact", 1, 2, 12, 24.0, 4.0, 1000.0, 3e-3, 0.6, steps_total=13),
    ]


def test_steps_are_the_newest_version_committed_within_the_budget():
    times = [(0, 8.6), (1, 108.2), (2, 148.0), (3, 197.6)]  # (version, s since the start)
    assert newest_within(times, 150) == 2
    assert newest_within(times, 197.6) == 3
    assert newest_within(times, 5) is None


def test_step_means_stop_at_the_last_step_within_the_budget():
    history = [(1, 36.0), (2, 40.0), (3, 58.0)]
    assert mean_through(history, 2) == pytest.approx(38.0)  # (36 + 40) / 2
    assert mean_through(history, 3) == pytest.approx(134 / 3)
    assert mean_through(history, 0) is None


def test_arm_order_alternates_so_neither_arm_always_runs_first():
    assert [arm_order(i)[0] for i in range(4)] == ["exact", "loglinear", "exact", "loglinear"]
    assert all(sorted(arm_order(i)) == ["exact", "loglinear"] for i in range(4))


def test_ratios_divide_the_two_runs_of_the_same_seed():
    runs = two_seeds()
    # s / step: 20 / 16 = 1.25 and 24 / 18 = 4/3; steps: 10 / 12 and 12 / 14.
    assert seed_ratios(runs, 0)["step_time"] == pytest.approx(1.25)
    assert seed_ratios(runs, 1)["step_time"] == pytest.approx(4 / 3)
    assert seed_ratios(runs, 0)["steps"] == pytest.approx(10 / 12)
    assert seed_ratios(runs, 1)["steps"] == pytest.approx(12 / 14)


def test_arm_means_and_sample_stds_over_seeds():
    exact = arm_stats(two_seeds(), "exact")
    # steps 10, 12: mean 11, sample std sqrt((1 + 1) / 1) = sqrt 2.
    assert (exact["steps"].mean, exact["steps"].std) == pytest.approx((11, math.sqrt(2)))
    # s / step 20, 24: mean 22, std sqrt(8).
    assert (exact["step_time_s"].mean, exact["step_time_s"].std) == pytest.approx(
        (22, math.sqrt(8))
    )
    # π_prox share 2/20 = 0.1 and 4/24 = 1/6: mean 2/15, std (1/6 - 0.1) / sqrt 2.
    share = exact["proximal_share"]
    assert (share.mean, share.std) == pytest.approx((2 / 15, (1 / 6 - 0.1) / math.sqrt(2)))
    # Δ 0.3, 0.4: mean 0.35, std 0.1 / sqrt 2.
    assert (exact["delta"].mean, exact["delta"].std) == pytest.approx((0.35, 0.1 / math.sqrt(2)))
    loglinear = arm_stats(two_seeds(), "loglinear")
    assert loglinear["step_time_s"].mean == pytest.approx(17)
    assert loglinear["proximal_share"].mean == 0


def test_summary_prints_mean_and_std_per_arm():
    table = summary_table(two_seeds())
    exact_row = next(line for line in table.splitlines() if line.startswith("| exact"))
    cells = [c.strip() for c in exact_row.strip("|").split("|")]
    # arm, runs, steps, s/step, π_prox s, share, pass tokens, response tokens, k3, start,
    # final, Δ
    assert cells == [
        "exact",
        "2/2",
        "11.0 ± 1.4",
        "22.00 ± 2.83",
        "3.000 ± 1.414",
        "13.3 ± 4.7%",
        "900 ± 141",
        "-",
        "2.00e-03 ± 1.41e-03",
        "0.200 ± 0.000",
        "0.550 ± 0.071",
        "+0.350 ± 0.071",
    ]


def test_ratio_table_prints_each_seed_and_their_mean():
    lines = ratio_table(two_seeds()).splitlines()
    assert lines[2] == "| 0 | exact | 20.00 | 16.00 | 1.250 | 0.833 |"
    assert lines[3] == "| 1 | loglinear | 24.00 | 18.00 | 1.333 | 0.857 |"
    # mean of 1.25 and 4/3 = 1.2917, std (4/3 - 1.25) / sqrt 2 = 0.0589;
    # steps: mean of 0.8333 and 0.8571 = 0.8452, std 0.0168.
    assert lines[4] == "| mean ± std | | | | 1.292 ± 0.059 | 0.845 ± 0.017 |"


def test_seed_table_puts_both_arms_side_by_side():
    table = seed_table(two_seeds(), 1)
    assert table.startswith("seed 1 (loglinear ran first)")
    assert "| s / step | 24.00 | 18.00 | 1.33 |" in table
    assert "| π_prox share of step | 16.7% | 0.0% |  |" in table
    assert "| held-out Δ | +0.400 | +0.350 |  |" in table
    assert "| response tokens / step | - | 1100 |  |" in table
    # exact committed 13 versions, 12 of them within the budget; loglinear's total unknown.
    assert "| versions after the budget | 1 | - |  |" in table


def test_a_crashed_run_is_left_out_of_the_statistics_and_listed():
    runs = two_seeds()
    runs[3] = ArmRun("exact", 1, "e1", 2, error="RuntimeError: boom")
    assert runs[3].run_id == "e1"
    assert seed_ratios(runs, 1) == {"step_time": None, "steps": None}
    assert arm_stats(runs, "exact")["step_time_s"].n == 1
    text = report_text(runs)
    assert "| exact | 1/2 |" in text
    assert "| s / step | failed | 18.00 | - |" in text
    assert "- exact seed 1 (e1): RuntimeError: boom" in text
    # The mean ratio is that of the one complete seed.
    assert "| mean ± std | | | | 1.250 | 0.833 |" in text


def test_payload_holds_every_row_and_the_ratios():
    data = payload(two_seeds(), {"tag": "t"})
    assert data["tag"] == "t"
    assert [r["run_id"] for r in data["runs"]] == ["e0", "l0", "l1", "e1"]
    assert data["runs"][0]["proximal_share"] == pytest.approx(0.1)
    assert data["ratios"]["1"]["step_time"] == pytest.approx(4 / 3)
    assert data["arms"]["exact"]["step_time_s"]["mean"] == pytest.approx(22)


def args(tmp_path, *overrides: str, minutes: float = 2.0) -> argparse.Namespace:
    (tmp_path / "config.json").write_text("{}")
    return argparse.Namespace(
        model_path=str(tmp_path), seeds=1, minutes=minutes, overrides=list(overrides), out=None
    )


def test_every_run_is_stopped_by_the_clock_alone_and_evaluated_after(tmp_path):
    config = build_config(args(tmp_path, "evaluation.every=5", minutes=1.5))
    assert config.trainer.time_budget_s == 90
    assert config.trainer.total_steps == 100_000
    assert config.evaluation.during_run is False
    assert config.evaluation.every == 5  # an explicit --set wins over the bench's 0
    assert config.model.path == str(tmp_path.resolve())
    assert config.trainer.ppo_minibatches == 2
    # Up to η + 2 versions come after the budget; the one scored is kept: η 2 -> 5.
    assert config.storage.keep_versions == 5
    kept = build_config(args(tmp_path, "storage.keep_versions=9", "staleness.max_staleness=4"))
    assert kept.storage.keep_versions == 9
    assert build_config(args(tmp_path, "staleness.max_staleness=4")).storage.keep_versions == 7


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.loss.proximal=exact"], "sets trainer.loss.proximal itself"),
        (["trainer.time_budget_s=60"], "use --minutes"),
        (["trainer.ppo_minibatches=1"], "the bench needs 2+"),
    ],
)
def test_settings_the_bench_owns_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(args(tmp_path, *overrides))
