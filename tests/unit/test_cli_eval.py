"""`sluice eval` refuses what does not exist with one line and exit code 2, before any flow.

Runs are found the way `sluice train` leaves them ({workdir}/runs/{run}/config.json); the
registry is a real MLflow sqlite store, one per module (creating its tables costs seconds).
Prefect is never started: every case here stops before the flow would run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sluice.flows.cli import main, resolve_run
from sluice.infra.checkpoints import save_checkpoint
from sluice.infra.config.run import RunConfig, load_config
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.tracking import get_client
from sluice.tasks.run.paths import registered_model_name


def _save_run(workdir: Path, run_id: str, config: RunConfig) -> Path:
    path = workdir / "runs" / run_id / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.model_dump_json(indent=2))
    return path


@pytest.fixture(scope="module")
def run_config(
    local_run_config: Callable[..., RunConfig], tmp_path_factory: pytest.TempPathFactory
) -> RunConfig:
    return local_run_config(tmp_path_factory.mktemp("cli-eval"))


@pytest.fixture(scope="module")
def workdir(run_config: RunConfig) -> Path:
    """A workdir with runs 'empty' and 'trained', as `sluice train` leaves them."""
    work = Path(run_config.workdir)
    _save_run(work, "empty", run_config)
    _save_run(work, "trained", run_config)
    return work


@pytest.fixture(scope="module")
def committed(run_config: RunConfig, workdir: Path) -> Path:
    """Run 'trained' has policy versions 0 and 1 in MLflow; run 'empty' has none."""
    weights = workdir.parent / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    registry = CheckpointRegistry(
        run_config.tracking.uri, registered_model_name(run_config, "trained")
    )
    checkpoints = f"{run_config.storage.url}/trained/checkpoints"  # the run's own prefix
    for policy_version in (0, 1):
        (weights / "model.safetensors").write_bytes(bytes([policy_version]) * 16)
        url = f"{checkpoints}/v{policy_version:06d}"
        registry.commit(policy_version, save_checkpoint(weights, url))
    return workdir


def _eval(capsys: pytest.CaptureFixture[str], workdir: Path, *args: str) -> tuple[int, str]:
    code = main(["eval", "--set", f"workdir={workdir}", *args])
    return code, capsys.readouterr().err


def test_unknown_run_exits_2_with_one_line_naming_the_run(capsys, workdir):
    code, err = _eval(capsys, workdir, "--run", "no-such-run")
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "run 'no-such-run' not found" in err
    assert "empty, trained" in err  # says which runs do exist


def test_run_id_that_is_a_path_is_not_followed(capsys, workdir):
    code, err = _eval(capsys, workdir, "--run", "../work/runs/trained")
    assert code == 2
    assert "not found" in err


def test_no_runs_in_workdir_exits_2(capsys, tmp_path):
    code, err = _eval(capsys, tmp_path / "nothing-here")
    assert code == 2
    assert err.count("\n") == 1
    assert "no runs to evaluate" in err


def test_missing_version_exits_2_with_one_line_listing_committed_versions(capsys, committed):
    code, err = _eval(capsys, committed, "--run", "trained", "--version", "7")
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "run 'trained' has no policy version 7" in err
    assert "committed: 0, 1" in err


def test_run_without_registered_versions_exits_2_and_registers_nothing(
    capsys, run_config, committed
):
    code, err = _eval(capsys, committed, "--run", "empty")
    assert code == 2
    assert err.count("\n") == 1
    assert "run 'empty' has no committed policy versions" in err
    client = get_client(run_config.tracking.uri)
    name = registered_model_name(run_config, "empty")
    assert client.search_registered_models(filter_string=f"name = '{name}'") == []


def test_eval_uses_the_runs_saved_config_with_set_on_top(run_config, workdir):
    cli_config = load_config(None, [f"workdir={workdir}"])
    run_id, config = resolve_run(
        cli_config, "trained", [f"workdir={workdir}", "evaluation.samples=3"]
    )
    assert run_id == "trained"
    # Storage and tracking come from the run, not from the CLI's default config.
    assert config.tracking.uri == run_config.tracking.uri != cli_config.tracking.uri
    assert config.storage.url == run_config.storage.url
    assert config.evaluation.samples == 3


def test_eval_without_run_picks_the_run_whose_config_was_written_last(workdir):
    runs = workdir / "runs"
    os.utime(runs / "empty" / "config.json", (1_000, 1_000))
    os.utime(runs / "trained" / "config.json", (2_000, 2_000))
    cli_config = load_config(None, [f"workdir={workdir}"])
    assert resolve_run(cli_config, None, [])[0] == "trained"
    os.utime(runs / "empty" / "config.json", (3_000, 3_000))
    assert resolve_run(cli_config, None, [])[0] == "empty"
