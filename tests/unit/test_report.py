"""The run report against a real MLflow sqlite store: the UI link and the reward curves.

One sqlite database per module (creating MLflow's tables costs seconds). The run lives
in an experiment of its own, so its id is not MLflow's default experiment 0.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from sluice.infra.checkpoints import save_checkpoint  # noqa: E402
from sluice.infra.config.run import RunConfig  # noqa: E402
from sluice.infra.tracking import get_client, log_metrics, start_or_resume_run  # noqa: E402
from sluice.tasks.run.paths import run_paths, run_registry  # noqa: E402
from sluice.tasks.run.report import (  # noqa: E402
    REWARD_CURVE_ARTIFACT,
    log_reward_curves,
    rewards_by_time,
    summarise,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def config(
    local_run_config: Callable[..., RunConfig], tmp_path_factory: pytest.TempPathFactory
) -> RunConfig:
    config = local_run_config(tmp_path_factory.mktemp("report"), "tracking.experiment=report-test")
    get_client(config.tracking.uri)  # create the tables once for the whole module
    return config


def start_run(config: RunConfig, run_id: str) -> str:
    return start_or_resume_run(
        config.tracking.uri,
        config.tracking.experiment,
        run_name=run_id,
        artifact_location=config.tracking.artifact_location,
    )


def commit_version(config: RunConfig, run_id: str, version: int, tmp_path: Path) -> int:
    """Commit a tiny sealed checkpoint as `version`; returns its commit time in ms."""
    source = tmp_path / f"v{version}"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}')
    # Under the run's own prefix: a run's registry reads no other source.
    uri = save_checkpoint(source, run_paths(config, run_id).checkpoint(version))
    return run_registry(config, run_id).commit(version, uri).created_at_ms


def test_run_url_names_the_runs_experiment(config):
    mlflow_run_id = start_run(config, "url-run")
    client = get_client(config.tracking.uri)
    experiment_id = client.get_run(mlflow_run_id).info.experiment_id
    assert experiment_id != "0"

    summary = summarise(config, "url-run", mlflow_run_id)

    assert summary["mlflow_run_url"] == (
        f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{mlflow_run_id}"
        "?workflowType=machine_learning"
    )


def test_reward_curves_land_in_the_run_as_a_png(config, tmp_path):
    import matplotlib.image

    mlflow_run_id = start_run(config, "curve-run")
    for version in range(3):
        commit_version(config, "curve-run", version, tmp_path)
    uri = config.tracking.uri
    for step, reward in ((1, 0.2), (2, 0.4)):
        log_metrics(uri, mlflow_run_id, {"reward/mean": reward}, step=step)
    for version, reward in ((0, 0.3), (2, 0.5)):
        log_metrics(uri, mlflow_run_id, {"eval/reward": reward}, step=version)

    path = log_reward_curves(config, "curve-run", mlflow_run_id)

    client = get_client(uri)
    assert path == REWARD_CURVE_ARTIFACT
    assert [a.path for a in client.list_artifacts(mlflow_run_id, "plots")] == [path]
    png = Path(client.download_artifacts(mlflow_run_id, path, str(tmp_path / "out")))
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(png).shape  # decodes, so the file is whole
    # Two panels side by side (by policy version, by seconds) make a wide image.
    assert width > 2 * height


def test_held_out_reward_is_placed_at_its_versions_commit_time():
    committed_at_ms = {0: 10_000, 1: 12_000, 2: 15_500}
    # Version 2 was evaluated long after its commit; the curve uses the commit.
    held_out = [(0, 0.3), (2, 0.5)]
    # Step 2 is logged twice: a resumed run re-trained it later.
    train_timeline = [(1, 0.2, 12_100), (2, 0.4, 13_000), (2, 0.45, 15_600)]

    train, evaluated = rewards_by_time(train_timeline, held_out, committed_at_ms)

    assert evaluated == [(0.0, 0.3), (5.5, 0.5)]
    assert train == [(2.1, 0.2), (3.0, 0.4), (5.6, 0.45)]


def test_rewards_have_no_time_axis_without_version_zero():
    assert rewards_by_time([(1, 0.2, 12_100)], [(1, 0.3)], {1: 12_000}) == ([], [])
