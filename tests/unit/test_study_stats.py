"""Study statistics: mean ± sample std over seeds, the collapse rule, and the table rows,
checked against numbers worked by hand."""

import math

import pytest

from sluice.flows.bench.study_stats import (
    MISMATCH_MODES,
    STALENESS_ETAS,
    MeanStd,
    SeedRun,
    failure_lines,
    is_collapsed,
    mean_std,
    mismatch_cells,
    mismatch_table,
    staleness_cells,
    staleness_table,
    summarise,
)


def cells_of(table: str, first: str) -> list[str]:
    row = next(line for line in table.splitlines() if line.startswith(f"| {first} "))
    return [c.strip() for c in row.strip().strip("|").split("|")]


def test_mean_std_uses_the_sample_std_over_finite_values():
    # deviations from 0.44: -0.04, 0, +0.04 -> sum of squares 0.0032 / (3 - 1) -> std 0.04
    stats = mean_std([0.40, 0.44, 0.48, None, math.nan])
    assert stats.n == 3
    assert stats.mean == pytest.approx(0.44)
    assert stats.std == pytest.approx(0.04)
    assert stats.format(".3f") == "0.440 ± 0.040"


def test_mean_std_of_one_value_has_no_std_and_of_none_is_a_dash():
    assert mean_std([0.5]) == MeanStd(0.5, None, 1)
    assert mean_std([0.5]).format(".3f") == "0.500"
    assert mean_std([None, math.nan]).format(".3f") == "-"


def test_collapse_is_a_drop_of_more_than_a_tenth_or_any_nan_loss():
    assert is_collapsed(0.40, 0.29, 0)  # 0.29 < 0.40 - 0.1
    assert not is_collapsed(0.40, 0.31, 0)  # lower, but within 0.1
    assert not is_collapsed(0.40, 0.55, 0)
    assert is_collapsed(0.40, 0.55, 1)  # a NaN loss collapses even a run that improved
    assert is_collapsed(0.40, math.nan, 0)
    assert not is_collapsed(None, 0.1, 0)  # no start to compare with: no evidence


def run(cell, seed, start, final, **kw):
    return SeedRun(cell, seed, f"{cell}-{seed}", held_out_start=start, held_out_final=final, **kw)


def test_summary_leaves_crashed_runs_out_and_counts_collapses_among_the_rest():
    runs = [
        run("4 naive", 0, 0.36, 0.20, staleness_max=4, kl_k3_mean=0.01),
        run("4 naive", 1, 0.38, 0.40, staleness_max=3, kl_k3_mean=0.03),
        SeedRun("4 naive", 2, "4 naive-2", error="RoleFailed: trainer exited 1"),
    ]
    stats = summarise(runs)
    assert (stats.completed, stats.failed, stats.collapsed) == (2, 1, 1)
    assert stats.start.mean == pytest.approx(0.37)
    # Δ per seed: -0.16 and +0.02 -> mean -0.07, std sqrt(2 · 0.09² / 1) = 0.1273
    assert stats.delta.mean == pytest.approx(-0.07)
    assert stats.delta.std == pytest.approx(math.sqrt(2 * 0.09**2))
    assert stats.staleness_max == 4
    assert stats.kl_k3.mean == pytest.approx(0.02)
    assert failure_lines(runs) == [
        "- failed: 4 naive seed 2 (4 naive-2): RoleFailed: trainer exited 1"
    ]


def test_staleness_table_row_shows_mean_std_delta_staleness_kl_and_collapses():
    cells = staleness_cells([4], ["decoupled"])
    runs = [
        run("4 decoupled", 0, 0.36, 0.44, staleness_max=4, kl_k3_mean=1e-3),
        run("4 decoupled", 1, 0.40, 0.46, staleness_max=4, kl_k3_mean=3e-3),
        run("4 decoupled", 2, 0.38, 0.48, staleness_max=3, kl_k3_mean=2e-3, nan_loss_steps=2),
    ]
    table = staleness_table(cells, runs)
    assert "| η | objective | held-out start | final | Δ |" in table.splitlines()[0]
    # start 0.36/0.40/0.38 -> 0.380 ± 0.020; final 0.44/0.46/0.48 -> 0.460 ± 0.020;
    # Δ 0.08/0.06/0.10 -> +0.080 ± 0.020; k3 1e-3/3e-3/2e-3 -> 2e-3 ± 1e-3.
    assert cells_of(table, "4") == [
        "4",
        "decoupled",
        "0.380 ± 0.020",
        "0.460 ± 0.020",
        "+0.080 ± 0.020",
        "4",
        "2.00e-03 ± 1.00e-03",
        "1/3",
    ]


def test_mismatch_table_row_shows_correction_weights_and_masking():
    cells = mismatch_cells(["sequence_mis"])
    runs = [
        run(
            "sequence_mis",
            s,
            0.36,
            final,
            kl_k3_mean=8e-3,
            masked_fraction_mean=masked,
            is_weight_mean=0.98,
            is_weight_max=w_max,
            ess_mean=0.9,
        )
        for s, (final, masked, w_max) in enumerate([(0.40, 0.02, 1.9), (0.42, 0.04, 1.7)])
    ]
    row = cells_of(mismatch_table(cells, runs), "sequence_mis")
    # masked 0.02/0.04 -> 0.030 ± 0.014 (std = 0.01·√2); IS max is the max over seeds.
    assert row == [
        "sequence_mis",
        "0.360 ± 0.000",
        "0.410 ± 0.014",
        "+0.050 ± 0.014",
        "8.00e-03 ± 0.00e+00",
        "0.030 ± 0.014",
        "0.980 ± 0.000",
        "1.9",
        "0.900 ± 0.000",
        "0/2",
    ]


def test_tables_skip_cells_without_runs():
    table = staleness_table(staleness_cells(), [run("0 naive", 0, 0.3, 0.3)])
    assert len(table.splitlines()) == 3


def test_default_cells_cover_every_eta_both_ways_and_the_four_modes():
    cells = staleness_cells()
    assert len(cells) == 2 * len(STALENESS_ETAS)
    assert {
        (c.settings["staleness.max_staleness"], c.settings["trainer.loss.decoupled"]) for c in cells
    } == {(e, d) for e in STALENESS_ETAS for d in (True, False)}
    assert cells[0].slug == "eta0-decoupled"
    assert [c.settings["trainer.correction.mode"] for c in mismatch_cells()] == list(MISMATCH_MODES)
    assert mismatch_cells()[1].slug == "token-tis"
