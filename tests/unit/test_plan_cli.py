"""`sluice plan` from datasheet figures end to end, the published-results table, and
bad input: one line, exit code 2, nothing started."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.engines.planner.hardware import Efficiency
from sluice.flows.cli import main
from sluice.flows.planner.published import PUBLISHED, anchor_mean_tokens, simulated_sync, table_b


def _config_args(root: Path) -> list[str]:
    settings = {
        "workdir": str(root / "work"),
        "tracking.uri": f"sqlite:///{root}/mlflow.db",
        "tracking.artifact_location": str(root / "mlartifacts"),
    }
    return [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]


def test_a_hardware_plan_recommends_a_split_and_writes_its_plot(tmp_path, capsys) -> None:
    code = main(
        [
            "plan",
            *_config_args(tmp_path),
            "--hardware",
            "h100",
            "--model",
            "qwen2.5-1.5b",
            "--devices",
            "8",
            "--eta",
            "1",
            "--eta",
            "4",
            "--batch",
            "64",
            "--response-mean",
            "2000",
            "--max-new-tokens",
            "8192",
            "--steps",
            "6",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    # Splits 1:7 .. 7:1 at two η each, and the sync baseline.
    assert (
        sum(line.startswith("| ") and ":" in line.split("|")[1] for line in out.splitlines()) >= 12
    )
    assert "**recommended**" in out and "H100 SXM: 989 TFLOPS" in out
    assert len(list((tmp_path / "work" / "plans").glob("plan-*.png"))) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "needs either --from-run RUN or --hardware"),
        (
            ["--hardware", "tpu9", "--model", "qwen2.5-7b", "--devices", "8"],
            "unknown --hardware 'tpu9'",
        ),
        (
            ["--hardware", "h100", "--model", "llama-9b", "--devices", "8"],
            "unknown --model 'llama-9b'",
        ),
        (["--hardware", "h100", "--model", "qwen2.5-7b"], "--hardware needs --devices"),
        (["--from-run", "nowhere"], "run 'nowhere' not found"),
    ],
)
def test_bad_plan_input_is_one_line_and_exit_code_2(tmp_path, capsys, args, message) -> None:
    assert main(["plan", *_config_args(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sluice: error:") and message in err and "\n" not in err
    assert not (tmp_path / "work" / "plans").exists()


def test_a_pinned_mean_length_reproduces_the_papers_sync_training_time() -> None:
    verl = next(p for p in PUBLISHED if p.train_anchor_s is not None)
    mean = anchor_mean_tokens(verl, Efficiency())
    trained = simulated_sync(verl, mean, Efficiency()).train_s_per_step
    assert trained == pytest.approx(verl.train_anchor_s, rel=0.01)


def test_the_published_table_has_a_row_per_result_and_says_what_it_assumed() -> None:
    lines = table_b()
    rows = [line for line in lines if line.startswith("| ") and "×" in line]
    assert len(rows) == len(PUBLISHED)
    for p in PUBLISHED:
        assert any(line.startswith(f"| {p.label}:") for line in rows)
        assert any(line.startswith(f"- {p.label}:") for line in lines)  # its notes
    assert any("assumed efficiencies" in line for line in lines)


def test_validation_table_a_predicts_each_run_from_the_calibration_runs_only() -> None:
    from sluice.engines.planner.calibrate import calibrate
    from sluice.flows.planner.validation import CPU_RUNS, table_a
    from tests.unit.planner_runs import measured_run

    measured = {
        run.label: measured_run(
            run.mode,
            2 if run.mode == "sync" else 1,
            1e-3,
            4e-6,
            max_staleness=run.max_staleness,
            generate_s_per_step=0.1 if run.mode == "sync" else None,
            rollout_idle_ratio=None if run.mode == "sync" else 0.3,
        )
        for run in CPU_RUNS
    }
    calibration = calibrate([measured[r.label] for r in CPU_RUNS if r.calibration])
    rows = [
        line for line in table_a(measured, calibration) if line.startswith("| ") and "%" in line
    ]
    assert [row.split("|")[1].strip() for row in rows] == [
        r.label for r in CPU_RUNS if not r.calibration
    ]
    # Measured 1,000 trained tokens/s in every run: each row prints it and its error.
    assert all("| 1,000 |" in row and "% |" in row for row in rows)
