"""Servable before durable, measured: `sluice train` against `--sync` under one
durability policy each, side by side in one invocation (docs/design.md §2).

Arms, each a real run of the same config for the same wall time (`--seconds`,
`trainer.time_budget_s`, start-up included) from the same version 0, one after another:

- ``async N=1`` / ``sync N=1``: every version durable (`checkpoint.every_versions: 1`,
  the behaviour before the split): the "before";
- ``async N=K`` / ``sync N=K``: a version durable every K (`--every`), the rest servable
  only: the "after";
- ``async N=K slow storage``: as ``async N=K``, with every checkpoint file sleeping
  `--slow-s` on its way to storage (the ``checkpoint.put_file`` failpoint);
- ``async N=K all cores``: as ``async N=K`` with every role on all the cores
  (`threads_per_role` = the core count, OpenMP's waiting threads passive): the trainer
  and the server share the cores through the scheduler instead of half each;
- ``control (no publish)``: the trainer publishes nothing (`trainer.publish_every` past
  the run, eta past it too, so the rollout never waits): its steps are the training
  compute alone.

Per arm, from the run's `metrics.jsonl` and status documents: steps, steps per second,
the trainer's per-step timeline medians (states that add up to the step), seconds
between versions and that minus the step's compute (pi_prox + train), versions whose
durability was skipped, the durability lag, bytes made durable and the durable
thread's CPU seconds per durable version, and each role's CPU seconds per step. Ratios
are against the arms of the same invocation only.

    python tests/benchmarks/bench_durability.py --model-path DIR [--seconds 180]
        [--every 10] [--slow-s 0.5] [--arms 'async N=1,sync N=1'] [--set key=value ...]

The small-batch config of the issue that asked for it is the default: `reasoning_gym`
with `trainer.prompts_per_batch=2 rollout.group_size=4 rollout.max_new_tokens=16`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SMALL_BATCH = {
    "trainer.prompts_per_batch": 2,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 16,
    "trainer.total_steps": 100000,
    "evaluation.during_run": False,
}
STATES = ("wait_data", "proximal", "train", "publish", "other")


def arms(every: int) -> dict[str, tuple[str, dict[str, Any], bool]]:
    """label -> (mode, settings, slow storage)."""
    return {
        "async N=1": ("async", {"checkpoint.every_versions": 1}, False),
        "sync N=1": ("sync", {"checkpoint.every_versions": 1}, False),
        f"async N={every}": ("async", {"checkpoint.every_versions": every}, False),
        f"sync N={every}": ("sync", {"checkpoint.every_versions": every}, False),
        f"async N={every} slow storage": ("async", {"checkpoint.every_versions": every}, True),
        # Every role with all the cores (async trains on half of them by default): the
        # trainer and the server share them by the scheduler, idle threads not spinning.
        f"async N={every} all cores": (
            "async",
            {"checkpoint.every_versions": every, "threads_per_role": os.cpu_count() or 1},
            False,
        ),
        "control (no publish)": (
            "async",
            {"trainer.publish_every": 100000, "staleness.max_staleness": 1000},
            False,
        ),
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(lines: list[dict[str, Any]], statuses: dict[str, Any], wall_s: float) -> dict:
    """One arm's numbers from its per-step metrics and final status documents.

    A step whose batch holds no informative group (`advantage.drop_zero_variance_groups`)
    trains nothing: medians of compute are over the steps that trained. The overhead
    between versions is the time between two published versions less the later step's
    compute and its wait for data: what publishing costs the trainer."""
    steps = len(lines)
    trained = [ln for ln in lines if ln.get("train/samples", 0) > 0]
    out: dict[str, Any] = {"steps": steps, "steps_per_s": steps / wall_s if wall_s else None}
    last = lines[-1] if lines else {}
    out["trained tokens/s"] = last.get("train/effective_tokens_per_s")
    out["steps that trained"] = len(trained)
    for state in STATES:
        out[f"median {state} s"] = median([ln.get(f"time/{state}_s", 0.0) for ln in trained])
    out["median step s"] = median([ln["time/step_s"] for ln in trained if "time/step_s" in ln])

    def compute(ln: dict[str, Any]) -> float:
        return ln.get("time/train_s", 0.0) + ln.get("time/proximal_s", 0.0)

    out["median compute s"] = median([compute(ln) for ln in trained])
    published = [ln for ln in lines if "train/publish_wait_s" in ln or "train/commit_s" in ln]
    gaps = [
        (b["train/wall_time_s"] - a["train/wall_time_s"], b)
        for a, b in zip(published, published[1:], strict=False)
        if "train/wall_time_s" in a and "train/wall_time_s" in b
    ]
    overhead = [g - compute(b) - b.get("time/wait_data_s", 0.0) for g, b in gaps]
    out["median s between versions"] = median([g for g, _ in gaps])
    out["median overhead between versions s"] = median(overhead)
    out["max overhead between versions s"] = max(overhead) if overhead else None
    out["versions skipped"] = last.get("train/durability_skipped")
    lags = [ln.get("train/durability_lag_s", 0.0) for ln in lines]
    out["max durability lag s"] = max(lags) if lags else None
    durable = [ln for ln in lines if "train/commit_bytes" in ln]
    commits = sorted({(ln.get("train/commit_s"), ln["train/commit_bytes"]) for ln in durable})
    out["durable versions"] = len(commits)
    out["median bytes made durable"] = median([b for _, b in commits])
    out["median commit GB/s"] = median([ln.get("train/commit_gb_per_s", 0.0) for ln in durable])
    cpu = last.get("background/durable_cpu_s") or last.get("background/cpu_s")
    out["durable CPU s per durable version"] = cpu / len(commits) if cpu and commits else None
    for role, status in statuses.items():
        role_cpu = status.get("time/cpu_s")
        if role_cpu is not None and steps:
            out[f"{role} CPU s per step"] = role_cpu / steps
    return out


def run_arm(base: Any, label: str, mode: str, settings: dict[str, Any], slow: bool, args) -> dict:
    from sluice.flows.bench.async_vs_sync import with_settings
    from sluice.flows.train import train
    from sluice.flows.train_sync import train_sync
    from sluice.infra.failpoints import ENV
    from sluice.tasks.run.metrics_file import metrics_file
    from sluice.tasks.run.paths import run_paths
    from sluice.tasks.run.status import read_statuses

    name = "dur-" + "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-")
    config = with_settings(base, {**settings, "name": name[:60]})
    plan = Path(tempfile.mkdtemp()) / "failpoints.json"
    if slow:
        plan.write_text(json.dumps({"checkpoint.put_file": {"sleep_s": args.slow_s}}))
        os.environ[ENV] = str(plan)
    else:
        os.environ.pop(ENV, None)
    if "all cores" in label:  # OpenMP threads that wait sleep rather than spin
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    started = time.monotonic()
    (train if mode == "async" else train_sync)(config, run_id=name)
    os.environ.pop("OMP_WAIT_POLICY", None)
    wall_s = time.monotonic() - started
    os.environ.pop(ENV, None)
    lines = [json.loads(x) for x in metrics_file(config, name).read_text().splitlines()]
    statuses = read_statuses(config, run_paths(config, name))
    train_wall = max((ln.get("train/wall_time_s", 0.0) for ln in lines), default=wall_s)
    return {
        "label": label,
        "run_id": name,
        "flow_wall_s": wall_s,
        **summarise(lines, statuses, train_wall),
    }


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_table(rows: list[dict[str, Any]], every: int) -> None:
    keys = [k for k in rows[0] if k not in ("label", "run_id")]
    print("| arm | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for row in rows:
        print(f"| {row['label']} | " + " | ".join(fmt(row.get(k)) for k in keys) + " |")
    by = {row["label"]: row for row in rows}
    for a, s in (("async N=1", "sync N=1"), (f"async N={every}", f"sync N={every}")):
        for key in ("steps_per_s", "trained tokens/s"):
            if a in by and s in by and by[s].get(key):
                print(f"{a} / {s}: {by[a][key] / by[s][key]:.2f}x {key}")


def summarise_again(workdir: Path, every: int) -> list[dict[str, Any]]:
    """The rows of the runs under `workdir` (metrics files; role CPU from status files)."""
    rows = []
    for label in arms(every):
        name = "dur-" + "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-")
        found = list(workdir.rglob(f"{name[:60]}/metrics.jsonl"))
        if not found:
            continue
        lines = [json.loads(x) for x in found[0].read_text().splitlines()]
        statuses = {
            p.stem: json.loads(p.read_text()) for p in workdir.rglob(f"{name[:60]}/_status/*.json")
        }
        train_wall = max((ln.get("train/wall_time_s", 0.0) for ln in lines), default=0.0)
        rows.append({"label": label, "run_id": name, **summarise(lines, statuses, train_wall)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--config", default="reasoning_gym")
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--slow-s", type=float, default=0.5)
    parser.add_argument("--arms", default=None, help="comma-separated labels (default: all)")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--json", default=None, help="write the rows here too")
    parser.add_argument(
        "--summarise",
        default=None,
        metavar="WORKDIR",
        help="print the table again from the runs an earlier invocation left in WORKDIR",
    )
    args = parser.parse_args()
    if args.summarise:
        print_table(summarise_again(Path(args.summarise), args.every), args.every)
        return
    for var in ("DO_NOT_TRACK", "MLFLOW_DISABLE_TELEMETRY"):
        os.environ.setdefault(var, "true")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

    from sluice.infra.config.run import load_config

    settings = {**SMALL_BATCH, "trainer.time_budget_s": args.seconds}
    overrides = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in settings.items()]
    overrides = [*overrides, f"model.path={args.model_path}", *args.overrides]
    base = load_config(args.config, overrides)
    chosen = arms(args.every)
    if args.arms:
        wanted = [a.strip() for a in args.arms.split(",")]
        chosen = {k: v for k, v in chosen.items() if k in wanted}
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"config: {args.config} + {' '.join(overrides)}")
    rows = []
    for label, (mode, arm_settings, slow) in chosen.items():
        print(f"arm {label} ...", flush=True)
        rows.append(run_arm(base, label, mode, arm_settings, slow, args))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows, args.every)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
