"""One tiny cell of each learning-fidelity study through the real train flow: the table
gets its row, the report files exist, and MLflow holds them on a run named for the study."""

import json

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.tracking import get_client
from tests.flows.conftest import tiny_run_overrides

pytestmark = [pytest.mark.flows, pytest.mark.slow]


def tiny_study_config(tmp_path, **extra):
    return load_config(
        "default", tiny_run_overrides(tmp_path, **{"trainer.total_steps": 2, **extra})
    )


def bench_artifacts(config, name, tag):
    client = get_client(config.tracking.uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    (run,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"attributes.run_name = 'bench-{name}-{tag}'"
    )
    assert run.data.tags["sluice.bench"] == name
    return {a.path for a in client.list_artifacts(run.info.run_id, "bench")}


def test_staleness_study_runs_one_cell_and_logs_its_table(prefect_api, tmp_path):
    from sluice.flows.bench.studies import bench_staleness

    config = tiny_study_config(tmp_path)
    out = bench_staleness(
        config, etas=[1], objectives=["decoupled"], seeds=1, report_dir=str(tmp_path / "bench")
    )
    tag = out["tag"]
    report = (tmp_path / "bench" / f"staleness-{tag}.md").read_text()
    assert "| η | objective |" in report and "collapsed = final held-out reward below" in report
    row = next(line for line in report.splitlines() if line.startswith("| 1 | decoupled |"))
    assert row.endswith("| 0/1 |"), row  # one seed, finished, not collapsed
    (run,) = json.loads((tmp_path / "bench" / f"staleness-{tag}.json").read_text())["runs"]
    assert run["error"] is None and run["steps"] == 2 and run["staleness_max"] <= 1
    assert bench_artifacts(config, "staleness", tag) == {
        f"bench/staleness-{tag}.md",
        f"bench/staleness-{tag}.json",
    }


def test_mismatch_study_injects_noise_and_logs_the_correction_row(prefect_api, tmp_path):
    from sluice.flows.bench.studies import bench_mismatch

    config = tiny_study_config(
        tmp_path, **{"rollout.weight_noise_std": 0.05, "staleness.max_staleness": 0}
    )
    out = bench_mismatch(config, modes=["token_tis"], seeds=1, report_dir=str(tmp_path / "bench"))
    tag = out["tag"]
    report = (tmp_path / "bench" / f"mismatch-{tag}.md").read_text()
    assert "rollout.weight_noise_std 0.05" in report
    assert any(line.startswith("| token_tis |") for line in report.splitlines())
    (run,) = json.loads((tmp_path / "bench" / f"mismatch-{tag}.json").read_text())["runs"]
    assert run["error"] is None
    # η = 0: without the noise k3 is ~1e-13 (float rounding); with it, clearly above.
    assert run["kl_k3_mean"] > 1e-7, run
    assert run["is_weight_max"] <= config.trainer.correction.threshold  # token TIS caps at C
    assert f"bench/mismatch-{tag}.md" in bench_artifacts(config, "mismatch", tag)
