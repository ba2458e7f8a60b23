"""Read what a finished (or running) Sluice run measured, for the capacity planner.

Sources, all written by the run itself:
- MLflow metrics of the run (found through the registry: every committed version
  names the MLflow run that produced it): the trainer's per-step compute, trained
  tokens and micro-batches, wall time, idle ratios, commit times; a sync run's
  generation time per step;
- the roles' status documents on storage: the inference engine's step profile
  (``sluice.engines.inference.profile``), the rollout's weight-update pauses and busy time;
- the rollouts stream (async) or the sync role's status (sync): the prompt and
  response lengths it sampled.

The first ``skip_steps`` versions are left out of the window (start-up, first
weights); cumulative metrics are differenced over the window.
"""

from __future__ import annotations

from typing import Any

from sluice.engines.inference.profile import StepProfile
from sluice.engines.planner.calibrate import RunMeasurements, TrainStep
from sluice.infra.config.run import RunConfig
from sluice.infra.streams.reader import StreamReader
from sluice.infra.tracking import get_metric_history
from sluice.tasks.run.paths import ROLLOUTS, run_paths, run_registry
from sluice.tasks.run.status import read_statuses
from sluice.tasks.run.threads import role_threads
from sluice.tasks.train.role import BATCH_POLL_S

MAX_SHARDS = 60
"""Newest rollout shards read for the length distribution."""


class MeasurementError(ValueError):
    """The run lacks what the planner needs (one line saying what)."""


def _history(uri: str, mlflow_run_id: str, key: str) -> dict[int, float]:
    return dict(get_metric_history(uri, mlflow_run_id, key))


def _window(steps: list[int], skip_steps: int) -> tuple[int, int]:
    if len(steps) < 3:
        raise MeasurementError(
            f"the run logged {len(steps)} train steps; the planner needs at least 3"
        )
    first = steps[min(skip_steps, len(steps) - 2)]
    return first, steps[-1]


def _stream_lengths(config: RunConfig, run_id: str) -> tuple[list[int], list[int]]:
    reader = StreamReader(
        config.storage.url,
        run_id,
        ROLLOUTS,
        consumer="planner",
        storage_options=config.storage.options,
    )
    prompts: list[int] = []
    responses: list[int] = []
    for ref in reader.committed()[-MAX_SHARDS:]:
        table = reader.read(ref)
        prompts += [len(p) for p in table.column("prompt_token_ids").to_pylist()]
        responses += [len(r) for r in table.column("response_token_ids").to_pylist()]
    return prompts, responses


def measure_run(config: RunConfig, run_id: str, *, skip_steps: int = 5) -> RunMeasurements:
    """`config` is the run's own (``sluice.flows.run_dirs.resolve_run``)."""
    latest = run_registry(config, run_id).newest_servable()
    if latest is None or not latest.run_id:
        raise MeasurementError(f"run '{run_id}' has no committed policy version to read")
    uri, mlflow_run_id = config.tracking.uri, latest.run_id
    statuses = read_statuses(config, run_paths(config, run_id))
    train_status = statuses.get("train", {})
    sync = latest.tags.get("mode") == "sync"  # the sync loop tags the versions it commits
    wall = _history(uri, mlflow_run_id, "train/wall_time_s")
    first, last = _window(sorted(wall), skip_steps)
    window = [s for s in sorted(wall) if first < s <= last]
    compute = _history(uri, mlflow_run_id, "train/step_time_s")
    tokens = _history(uri, mlflow_run_id, "train/trained_tokens")
    micro = _history(uri, mlflow_run_id, "train/micro_batches")
    idle = _history(uri, mlflow_run_id, "train/idle_ratio")
    effective = _history(uri, mlflow_run_id, "train/effective_tokens_per_s")
    commits = list(_history(uri, mlflow_run_id, "train/commit_s").values())
    wall_s = wall[last] - wall[first]
    idle_s = idle[last] * wall[last] - idle[first] * wall[first]
    trained = effective[last] * wall[last] - effective[first] * wall[first]
    train_steps = tuple(
        TrainStep(compute[s], int(tokens[s]), int(micro.get(s, 1))) for s in window if s in compute
    )
    profile_data: dict[str, Any] | None
    rollout_idle: float | None = None
    if sync:
        profile_data = train_status.get("engine_profile")
        pairs = train_status.get("sampled_lengths") or []
        prompt_lengths, response_lengths = [p for p, _ in pairs], [r for _, r in pairs]
        generate = _history(uri, mlflow_run_id, "rollout/generate_time_s")
        busy = sum(generate.values())
        threads = int(train_status.get("threads") or role_threads(config, "sync"))
        rollout_threads = train_threads = threads
        updates, update_s = 0, 0.0
        generate_per_step: float | None = sum(generate[s] for s in window if s in generate) / len(
            window
        )
    else:
        rollout = statuses.get("rollout", {})
        profile_data = rollout.get("engine_profile")
        prompt_lengths, response_lengths = _stream_lengths(config, run_id)
        elapsed = rollout.get("tokens_generated", 0) / max(1e-9, rollout.get("tokens_per_s", 0))
        updates = int(rollout.get("weight_updates", 0))
        update_s = float(rollout.get("update_time_s", 0.0))
        busy = elapsed * (1.0 - rollout.get("idle_ratio", 0.0)) - update_s
        # The counts the roles ran with (status), else what this machine would give them.
        rollout_threads = int(rollout.get("threads") or role_threads(config, "rollout"))
        train_threads = int(train_status.get("threads") or role_threads(config, "train"))
        generate_per_step = None
        history = _history(uri, mlflow_run_id, "rollout/idle_ratio")
        if first in history and last in history:
            rollout_idle = (history[last] * wall[last] - history[first] * wall[first]) / max(
                1e-9, wall_s
            )
    if not profile_data:
        raise MeasurementError(
            f"run '{run_id}' has no engine step profile in its status documents "
            "(runs before this planner, or an external server that keeps none)"
        )
    return RunMeasurements(
        run_id=run_id,
        mode="sync" if sync else "async",
        rollout_threads=rollout_threads,
        train_threads=train_threads,
        prompts_per_batch=config.trainer.prompts_per_batch,
        group_size=config.rollout.group_size,
        max_staleness=config.staleness.max_staleness,
        interruptible=config.rollout.interruptible,
        publish_every=config.trainer.publish_every,
        slots_per_server=config.rollout.max_batch_size,
        max_tokens_per_micro_batch=config.trainer.max_tokens_per_micro_batch,
        response_lengths=tuple(response_lengths),
        prompt_lengths=tuple(prompt_lengths),
        profile=StepProfile.from_dict(profile_data),
        train_steps=train_steps,
        steps=last - first,
        wall_s=wall_s,
        trainer_idle_ratio=idle_s / max(1e-9, wall_s),
        trained_tokens_per_s=trained / max(1e-9, wall_s),
        rollout_busy_s=max(0.0, busy),
        weight_updates=updates,
        update_time_s=update_s,
        rollout_idle_ratio=rollout_idle,
        commit_s=sum(commits) / len(commits) if commits else 0.0,
        rollout_poll_s=config.rollout.poll_interval_s,
        reward_poll_s=config.reward.poll_interval_s,
        trainer_poll_s=BATCH_POLL_S,
        generate_s_per_step=generate_per_step,
    )
