"""`sluice plan --from-run` on real runs: a sync run and an async run of the tiny model
measure their own costs, and the planner reads them back and recommends a layout."""

import json
from pathlib import Path

import pytest

from sluice.flows.cli import main
from sluice.flows.planner.measurements import measure_run
from sluice.infra.config.run import load_config
from sluice.infra.tracking import get_client
from sluice.tasks.run.metrics_file import metrics_file
from tests.flows.conftest import flow_run_artifacts, tiny_run_overrides

pytestmark = pytest.mark.flows


def test_plan_from_a_sync_and_an_async_run_recommends_a_split_and_logs_its_plot(
    prefect_api, tmp_path, capsys
):
    from sluice.flows.train import train
    from sluice.flows.train_sync import train_sync

    overrides = tiny_run_overrides(tmp_path, **{"trainer.total_steps": 10})
    config = load_config("default", overrides)
    train_sync(config, run_id="measured-sync")
    train(config, run_id="measured-async")

    # What the runs left for the planner: step profiles, lengths, per-step timings.
    sync = measure_run(config, "measured-sync")
    asynchronous = measure_run(config, "measured-async")
    assert (sync.mode, asynchronous.mode) == ("sync", "async")
    for run in (sync, asynchronous):
        assert run.profile.decode_steps > 0 and run.profile.prefill_tokens > 0
        assert run.response_lengths and max(run.response_lengths) <= 12
        assert 0.0 <= run.trainer_idle_ratio <= 1.0 and run.trained_tokens_per_s > 0
        assert len(run.train_steps) == run.steps > 0
    assert asynchronous.weight_updates > 0 and asynchronous.rollout_idle_ratio is not None
    assert sync.generate_s_per_step is not None and sync.generate_s_per_step > 0
    # Each colocated step's time is split into states that add up to the step
    # (tasks/run/state_timer.py): generating, scoring and training are all in it.
    for line in metrics_file(config, "measured-sync").read_text().splitlines():
        step = json.loads(line)
        parts = {k: v for k, v in step.items() if k.startswith("time/") and k.endswith("_s")}
        total = parts.pop("time/step_s")
        assert sum(parts.values()) == pytest.approx(total, abs=1e-6)
        assert parts["time/generate_s"] > 0 and parts["time/train_s"] > 0

    capsys.readouterr()
    code = main(
        [
            "plan",
            *[a for o in overrides for a in ("--set", o)],
            "--from-run",
            "measured-async",
            "--from-run",
            "measured-sync",
            "--devices",
            "4",
            "--eta",
            "0",
            "--eta",
            "2",
            "--steps",
            "8",
        ]
    )
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, captured.err
    assert "**recommended**: rollout" in out
    assert "| all (sync) |" in out
    for split in ("1:3", "2:2", "3:1"):
        assert f"| {split}" in out
    assert "scaling exponents fitted from runs on 1 and [2] devices" in out
    plans = list((Path(config.workdir) / "plans").glob("plan-*.png"))
    assert len(plans) == 1 and plans[0].stat().st_size > 1000
    client = get_client(config.tracking.uri)
    runs = client.search_runs(
        [client.get_experiment_by_name(config.tracking.experiment).experiment_id],
        filter_string="attributes.run_name LIKE 'plan-%'",
    )
    assert len(runs) == 1  # the CLI's; the flow's below is the second
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id, "plots")}
    assert artifacts == {"plots/plan.png"}
    assert runs[0].data.params["recommended.max_staleness"] in {"0", "2"}

    # The same plan as a Prefect flow: its table is the flow run's markdown artifact.
    from sluice.flows.planner.plan import plan_runs

    state = plan_runs(config, ["measured-async"], devices=2, etas=[1], return_state=True)
    assert state.is_completed(), state.message
    best = state.result()
    assert (best["rollout_devices"], best["train_devices"], best["max_staleness"]) == (1, 1, 1)
    assert best["trained_tokens_per_s"] > 0 and Path(best["plot"]).is_file()
    artifacts = flow_run_artifacts(state.state_details.flow_run_id)
    assert any(a.key == "sluice-plan" and "**recommended**" in a.data for a in artifacts)
