"""The device run's table: what each `sluice train` run recorded, read back from its stores.

Each run of tests/gpu/device_run.sh has its own working directory (its `.sluice/`
holds the MLflow sqlite store, the run's files and the roles' status documents). Every
figure is one the run already records, the way tests/benchmarks/bench_default_run.py
reads them:

- steps, steps/s and trained tokens/s: the train role's status (`step`, `wall_time_s`,
  `trained_tokens_per_s` = trained tokens over the trainer's wall clock);
- generated tokens/s: the rollout role's status (`tokens_per_s`); the colocated sync
  loop has no rollout role, so there it is the responses' tokens (MLflow
  `response/length_mean` x B x G per step) over the same wall clock;
- trainer idle: MLflow `train/idle_ratio` (sync: the share of the loop spent
  generating); rollout idle: the rollout status (`idle_ratio`, held by the gate);
- commit -> served: the rollout status (`commit_to_served_s_median`: seconds from a
  version's commit in the registry to every server holding it);
- held-out reward and greedy accuracy at the first and last evaluated version: MLflow
  `eval/reward`, `eval/greedy_accuracy`;
- peak GPU memory: the device script's `nvidia-smi` samples (MiB used on the GPU, all
  processes), and the largest process;
- where a trainer step goes (a second table, medians over the steps): MLflow
  `train/step_time_s` (the optimizer work), `train/proximal_time_s`,
  `train/publish_stall_s` (the trainer waiting to publish: `publish_wait_s` for the
  previous version's durable write and commit, then `host_copy_s`), and on the
  background thread `train/checkpoint_write_s` and `train/commit_s` (upload and registry
  commit; of it, the trainer state's save and the policy's, side by side:
  `commit_state_s`, `commit_policy_s`).

    python tests/gpu/device_report.py --run async=DIR [--run sync=DIR] [--gpu async=FILE]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

NOTHING = "-"
STEP_PARTS = (
    "step_time_s",
    "proximal_time_s",
    "publish_stall_s",
    "publish_wait_s",
    "host_copy_s",
    "checkpoint_write_s",
    "commit_s",
    "commit_state_s",
    "commit_policy_s",
)


def run_figures(workdir: Path) -> dict[str, Any]:
    """One run's figures (None where the run recorded nothing)."""
    from sluice.flows.run_dirs import absolute_store_settings, resolve_run
    from sluice.infra.config.run import load_config
    from sluice.infra.tracking import get_client, get_metric_history
    from sluice.tasks.run.paths import run_paths
    from sluice.tasks.run.status import read_statuses

    settings = absolute_store_settings(workdir)
    run_id, config = resolve_run(load_config(None, settings), None, settings)
    uri = config.tracking.uri
    client = get_client(uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"attributes.run_name = '{run_id}'"
    )
    mlflow_run = runs[0].info.run_id if runs else None

    def history(key: str) -> list[tuple[int, float]]:
        return get_metric_history(uri, mlflow_run, key) if mlflow_run else []

    statuses = read_statuses(config, run_paths(config, run_id))
    train, rollout = statuses.get("train", {}), statuses.get("rollout", {})
    sync = not rollout
    steps = int(train.get("step") or 0)
    wall = train.get("wall_time_s")
    samples_per_step = config.trainer.prompts_per_batch * config.rollout.group_size
    if sync:
        lengths = history("response/length_mean")
        generated = sum(v for _, v in lengths) * samples_per_step
        generated_per_s = generated / wall if wall and lengths else None
    else:
        generated_per_s = rollout.get("tokens_per_s")
    idle = history("train/idle_ratio")
    held_out, greedy = history("eval/reward"), history("eval/greedy_accuracy")
    return {
        "run_id": run_id,
        "mode": "sync" if sync else "async",
        "steps": steps,
        "wall_s": wall,
        "steps_per_s": steps / wall if wall and steps else None,
        "generated_tokens_per_s": generated_per_s,
        "trained_tokens_per_s": train.get("trained_tokens_per_s"),
        "trainer_idle": idle[-1][1] if idle else train.get("idle_ratio"),
        "rollout_idle": None if sync else rollout.get("idle_ratio"),
        "commit_to_served_s": None if sync else rollout.get("commit_to_served_s_median"),
        "held_out": (held_out[0], held_out[-1]) if held_out else None,
        "greedy": (greedy[0], greedy[-1]) if greedy else None,
        "peak_rss_mb": {
            role: s.get("peak_rss_mb") for role, s in statuses.items() if s.get("peak_rss_mb")
        },
        "pids": {int(s["pid"]): role for role, s in statuses.items() if s.get("pid")},
        "step_parts": {
            key: statistics.median(v for _, v in points) if points else None
            for key in STEP_PARTS
            for points in [history(f"train/{key}")]
        },
    }


def gpu_peaks(samples: Path | None, pids: dict[int, str]) -> tuple[float | None, str]:
    """(peak MiB used on the GPU, the largest process's peak) from the sampler's lines:
    `epoch used_mib pid,mib;pid,mib;...`."""
    if samples is None or not samples.is_file():
        return None, ""
    peak, by_pid = None, {}
    for line in samples.read_text().splitlines():
        fields = line.split(maxsplit=2)
        if len(fields) < 2:
            continue
        try:
            used = float(fields[1])
        except ValueError:
            continue
        peak = used if peak is None else max(peak, used)
        for item in (fields[2] if len(fields) > 2 else "").split(";"):
            pid, _, mib = item.partition(",")
            try:
                key, value = int(pid.strip()), float(mib.strip())
            except ValueError:
                continue
            by_pid[key] = max(by_pid.get(key, 0.0), value)
    if not by_pid:
        return peak, ""
    pid, mib = max(by_pid.items(), key=lambda item: item[1])
    return peak, f"{pids.get(pid, f'pid {pid}')} {mib:.0f}"


def number(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return NOTHING
    return format(value, spec)


def curve(points: tuple[tuple[int, float], tuple[int, float]] | None) -> str:
    if not points:
        return NOTHING
    (v0, r0), (v1, r1) = points
    return f"{r0:.3f} (v{v0}) -> {r1:.3f} (v{v1})"


def table(rows: list[tuple[str, str, dict[str, Any], float | None, str]]) -> str:
    lines = [
        "| run | exit | steps | steps/s | generated tok/s | trained tok/s | trainer idle "
        "| rollout idle | commit -> served (median s) | held-out reward | greedy accuracy "
        "| peak GPU MiB (largest process) |",
        "|---" * 12 + "|",
    ]
    for label, exit_text, f, peak, largest in rows:
        lines.append(
            f"| {label} | {exit_text} | {f.get('steps', NOTHING)} "
            f"| {number(f.get('steps_per_s'), '.3f')} "
            f"| {number(f.get('generated_tokens_per_s'), ',.0f')} "
            f"| {number(f.get('trained_tokens_per_s'), ',.0f')} "
            f"| {number(f.get('trainer_idle'), '.2f')} | {number(f.get('rollout_idle'), '.2f')} "
            f"| {number(f.get('commit_to_served_s'), '.2f')} | {curve(f.get('held_out'))} "
            f"| {curve(f.get('greedy'))} | {number(peak, ',.0f')}"
            + (f" ({largest})" if largest else "")
            + " |"
        )
    return "\n".join(lines)


def parts_table(rows: list[tuple[str, str, dict[str, Any], float | None, str]]) -> str:
    lines = [
        "| run | s/step (trainer wall) | " + " | ".join(STEP_PARTS) + " |",
        "|---" * (2 + len(STEP_PARTS)) + "|",
    ]
    for label, _exit, f, _peak, _largest in rows:
        parts = f.get("step_parts") or {}
        per_step = f["wall_s"] / f["steps"] if f.get("wall_s") and f.get("steps") else None
        cells = [number(parts.get(key), ".2f") for key in STEP_PARTS]
        lines.append(f"| {label} | {number(per_step, '.2f')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pairs(items: list[str]) -> dict[str, Path]:
    out = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"device report: expected LABEL=PATH, got {item!r}")
        out[label] = Path(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", default=[], metavar="LABEL=DIR")
    parser.add_argument("--gpu", action="append", default=[], metavar="LABEL=FILE")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    gpu = pairs(args.gpu)
    rows, notes = [], []
    for label, workdir in pairs(args.run).items():
        exit_file = workdir / "exit.txt"
        exit_text = exit_file.read_text().strip() if exit_file.is_file() else NOTHING
        try:
            figures = run_figures(workdir)
        except Exception as exc:  # a run that died early: the row says so, the rest stand
            rows.append((label, exit_text, {}, None, ""))
            notes.append(f"- {label}: nothing to read in {workdir}: {type(exc).__name__}: {exc}")
            continue
        peak, largest = gpu_peaks(gpu.get(label), figures["pids"])
        rows.append((label, exit_text, figures, peak, largest))
        memory = ", ".join(f"{r} {mb:,.0f}" for r, mb in figures["peak_rss_mb"].items())
        notes.append(
            f"- {label}: run `{figures['run_id']}` ({figures['mode']}), trainer wall "
            f"{number(figures['wall_s'], '.0f')} s; peak RSS MiB: {memory or NOTHING}"
        )
    if args.title:
        print(f"{args.title}\n")
    print(table(rows))
    print()
    print("\n".join(notes))
    print("\nWhere a trainer step goes (medians, s):\n")
    print(parts_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
