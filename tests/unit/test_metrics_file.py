"""A training run's metrics where their tools look: `metrics.jsonl`, staleness buckets,
the lag histogram and MLflow's system metrics.

The real train role (tasks/train/role.py) trains a tiny policy for two steps on scored
shards written to a real stream, with a real sqlite MLflow run, then is resumed for a
third: `metrics.jsonl` holds one line per step with exactly the keys and values MLflow
holds for that step (and its timestamp), the resumed run appends, the per-lag counts
sum to each batch's samples, and the end-of-run histogram sums them over the run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from sluice.engines.rl.groups import group_key
from sluice.infra.checkpoints import save_checkpoint
from sluice.infra.config.run import RunConfig
from sluice.infra.streams.schema import table_from_rows
from sluice.infra.streams.writer import StreamWriter
from sluice.infra.system_metrics import start_system_metrics
from sluice.infra.tracking import (
    get_client,
    get_metric_history,
    get_metric_timeline,
    start_or_resume_run,
)
from sluice.tasks.run.metrics_file import loggable, metrics_file
from sluice.tasks.run.report import STALENESS_HISTOGRAM_ARTIFACT, log_staleness_histogram
from sluice.tasks.train.base import staleness_counts

ETA = 2
FIRST_TOKEN_VERSION = {0: 0, 1: 0, 2: 0, 3: 1, 4: 0, 5: 1}
"""Issue number -> the version its responses started on. B = 2, G = 2, so the steps
train at policy versions 0, 1, 2 on lags {0, 0}, {1, 0}, {2, 1} group by group."""


def scored_group(index: int) -> pa.Table:
    start = FIRST_TOKEN_VERSION[index]
    rows = [
        {
            "sample_id": f"{group_key(index)}-{k:03d}",
            "group_id": group_key(index),
            "prompt_id": f"p{index}",
            "prompt_token_ids": [5, 6],
            "response_token_ids": [7, 8, 9][: k + 2],
            "behaviour_logprobs": [-2.0, -2.0, -2.0][: k + 2],
            "token_versions": [start] * (k + 2),
            "finish_reason": "stop",
            "reward": float(k),
            "task": "t",
            "worker": "w",
        }
        for k in range(2)
    ]
    return table_from_rows(rows)


@dataclass
class Run:
    config: RunConfig
    mlflow_run_id: str
    lines_before_resume: list[str]
    lines: list[dict[str, Any]]


def train(config: RunConfig, mlflow_run_id: str, tiny_dir: Path | None) -> None:
    from sluice.tasks.train.role import TrainRole

    role = TrainRole(config, "run", mlflow_run_id)
    if tiny_dir is not None:
        role.registry.commit(0, save_checkpoint(tiny_dir, role.paths.checkpoint(0)))
    role.control.clear_done()  # as a resuming flow does
    try:
        role.run()
    finally:
        role.close()


@pytest.fixture(scope="module")
def run(
    one_torch_thread: None,
    local_run_config: Callable[..., RunConfig],
    tiny_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    root = tmp_path_factory.mktemp("metrics-file")
    settings = (
        "trainer.prompts_per_batch=2",
        "rollout.group_size=2",
        f"staleness.max_staleness={ETA}",
        "tracking.system_metrics_interval_s=0.2",
    )
    config = local_run_config(root, *settings, "trainer.total_steps=2")
    mlflow_run_id = start_or_resume_run(
        config.tracking.uri,
        config.tracking.experiment,
        run_name="run",
        artifact_location=config.tracking.artifact_location,
    )
    writer = StreamWriter(config.storage.url, "run", "scored", writer_id="reward")
    for index in FIRST_TOKEN_VERSION:
        writer.write(scored_group(index), shard_key=group_key(index))
    train(config, mlflow_run_id, tiny_dir)
    before = metrics_file(config, "run").read_text().splitlines()
    resumed = local_run_config(root, *settings, "trainer.total_steps=3")
    train(resumed, mlflow_run_id, None)
    text = metrics_file(config, "run").read_text()
    return Run(resumed, mlflow_run_id, before, [json.loads(line) for line in text.splitlines()])


def mlflow_step_metrics(config: RunConfig, mlflow_run_id: str) -> dict[int, dict[str, float]]:
    """Step -> {key: value} of every training metric MLflow holds for the run."""
    keys = get_client(config.tracking.uri).get_run(mlflow_run_id).data.metrics
    steps: dict[int, dict[str, float]] = {}
    for key in keys:
        if key.startswith("system/"):  # sampled on a clock, with steps of their own
            continue
        for step, value in get_metric_history(config.tracking.uri, mlflow_run_id, key):
            steps.setdefault(step, {})[key] = value
    return steps


def test_metrics_jsonl_has_one_line_per_step_with_mlflows_keys_and_values(run: Run) -> None:
    assert [line["step"] for line in run.lines] == [1, 2, 3]
    in_mlflow = mlflow_step_metrics(run.config, run.mlflow_run_id)
    for line in run.lines:
        logged = {k: v for k, v in line.items() if k not in ("step", "time")}
        assert logged == in_mlflow[line["step"]]
    # The wall-clock time is the timestamp MLflow got.
    timeline = get_metric_timeline(run.config.tracking.uri, run.mlflow_run_id, "reward/mean")
    assert [line["time"] for line in run.lines] == [at_ms / 1000 for _, _, at_ms in timeline]


def test_a_resumed_run_appends_to_the_same_file(run: Run) -> None:
    assert len(run.lines_before_resume) == 2
    text = metrics_file(run.config, "run").read_text()
    assert text.startswith("\n".join(run.lines_before_resume) + "\n")
    assert text.endswith("\n")


def test_lag_buckets_count_every_sample_of_each_batch(run: Run) -> None:
    expected = {1: [4, 0, 0], 2: [2, 2, 0], 3: [0, 2, 2]}  # from FIRST_TOKEN_VERSION
    for line in run.lines:
        buckets = [line[f"staleness/count_lag_{k}"] for k in range(ETA + 1)]
        assert buckets == expected[line["step"]]
        assert sum(buckets) == line["train/samples"] == 4
        assert f"staleness/count_lag_{ETA + 1}" not in line


def test_the_run_histogram_sums_the_lags_of_every_step(run: Run) -> None:
    artifact, counts = log_staleness_histogram(run.config, "run", run.mlflow_run_id)
    assert counts == [6, 4, 2]
    assert artifact == STALENESS_HISTOGRAM_ARTIFACT
    listed = get_client(run.config.tracking.uri).list_artifacts(run.mlflow_run_id, "plots")
    assert STALENESS_HISTOGRAM_ARTIFACT in {entry.path for entry in listed}


def test_the_training_role_samples_system_metrics_into_its_run(run: Run) -> None:
    cpu = get_metric_history(
        run.config.tracking.uri, run.mlflow_run_id, "system/cpu_utilization_percentage"
    )
    assert cpu and all(0 <= value <= 100 for _, value in cpu)
    memory = get_metric_history(
        run.config.tracking.uri, run.mlflow_run_id, "system/system_memory_usage_megabytes"
    )
    assert memory and all(value > 0 for _, value in memory)


def test_system_metrics_stay_off_at_interval_zero_or_without_a_run() -> None:
    assert start_system_metrics("sqlite:///unused.db", "some-run", 0) is None
    assert start_system_metrics("sqlite:///unused.db", "", 10.0) is None


def test_lags_past_eta_get_buckets_of_their_own_and_the_counts_stay_whole() -> None:
    table = pa.table({"version_start": pa.array([5, 5, 4, 1], pa.int32())})
    counts = staleness_counts(table, policy_version=5, max_staleness=2)
    # lags 0, 0, 1, 4 with eta = 2: buckets 0..4, zeros included.
    assert counts == {
        "staleness/count_lag_0": 2.0,
        "staleness/count_lag_1": 1.0,
        "staleness/count_lag_2": 0.0,
        "staleness/count_lag_3": 0.0,
        "staleness/count_lag_4": 1.0,
    }


def test_the_file_keeps_what_mlflow_keeps() -> None:
    numbers = loggable({"a": 1, "b": None, "c": math.nan, "d": math.inf, "e": 2.5})
    assert numbers == {"a": 1.0, "e": 2.5}
    with pytest.raises(ValueError, match="'f'"):
        loggable({"f": "text"})


def test_every_steps_time_states_add_up_to_the_step_and_the_proximal_pass_is_its_own(
    run: Run,
) -> None:
    for line in run.lines:
        states = {
            k: v
            for k, v in line.items()
            if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"
        }
        assert set(states) == {
            f"time/{s}_s" for s in ("start", "wait_data", "proximal", "train", "publish", "other")
        }
        assert sum(states.values()) == pytest.approx(line["time/step_s"], abs=1e-6)
        assert min(states.values()) >= 0.0
        # The π_prox pass the step measured is `proximal`, taken out of `train`.
        assert line["time/proximal_s"] == pytest.approx(line["train/proximal_time_s"])
        assert line["time/train_s"] + line["time/proximal_s"] >= line["train/step_time_s"]
        assert line["time/cpu_over_cores"] == 0.0
        assert line["background/busy_s"] >= 0.0 and line["background/cpu_s"] >= 0.0
    # Each run's first step holds its setup; its later steps none.
    assert [line["time/start_s"] > 0 for line in run.lines] == [True, False, True]
    # Every shard was written before training began: the trainer does not wait for data
    # (it reads and files the shards it has). (How much of the wall goes to `other`
    # depends on the machine's load: benchmarks report it, a test cannot bound it.)
    steps = sum(line["time/step_s"] for line in run.lines)
    assert sum(line["time/wait_data_s"] for line in run.lines) < 0.5 * steps
