"""Benchmark: a recipe's greedy held-out accuracy against wall-clock time, seed by seed.

Does a recipe learn a task, and does it keep what it learned? For each seed (``seed``,
``seed+1``, ...) the script runs the config through the async ``train`` flow for
``--minutes`` of wall time (``trainer.time_budget_s``, start-up included), nothing
evaluated while the clock runs (``evaluation.during_run=false``). Retention keeps every
``evaluation.every``-th version (``--every``) and the newest few; after the run those
versions are scored greedily (temperature 0, one decoding per prompt) on the config's
held-out prompts, on the cores the run has left, so a curve costs the run no time. Then
the run's checkpoints are deleted.

Per run: held-out greedy accuracy at version 0 (the start; with ``model.supervised``,
the model given in ``model.path``, before the run's supervised pass made version 0), its
peak, the newest version committed within the budget (the final), and the mean over the
versions committed in the last third of the budget (the hold). A recipe *holds* its gain on a seed when both
the final and the hold are at least ``--target`` (0.15 by default) above the start: a
single final point can be lucky, and a mean over the last third cannot be a peak that
fell back.

Printed: one curve per run (minute, version, accuracy), a table of every run, and mean
± sample std over the seeds. Every row goes to ``--out`` (JSON, with a ``.md`` copy of
the report beside it).

    python tests/benchmarks/bench_recipe.py --model-path DIR [--config reasoning_gym_mix] \\
        [--seeds 3] [--minutes 30] [--set KEY=VALUE ...] [--label NAME]

A run takes ``--minutes`` plus ~1 minute of start-up and ~3 minutes of scoring.

``--ceiling K`` trains nothing: it samples K responses per held-out prompt from the
start policy at the rollout temperature and prints pass@1 and pass@K, overall and by
term count. Group-relative RL mostly sharpens what the policy already samples, so
pass@K of the start policy is a rough ceiling for the greedy accuracy a short run can
reach (a prompt the policy never solves in K tries gives no gradient toward solving it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sluice.flows.bench.study_stats import mean_std

CONFIG = "reasoning_gym_mix"
BENCH_DEFAULTS: dict[str, Any] = {
    # The recipe's own `trainer.total_steps` stays (a learning-rate decay ends there).
    "evaluation.during_run": False,
}
"""Settings every run takes unless `--set` names the key."""
SET_BY_BENCH: dict[str, str] = {
    "trainer.time_budget_s": "use --minutes",
    "model.path": "use --model-path",
    "evaluation.every": "use --every",
    "name": "each run is named by the bench",
}
"""Keys each run gets from the bench itself; a --set of one would be overwritten."""


@dataclass
class RecipeRun:
    """One run of the recipe with one seed, scored after it stopped."""

    seed: int
    run_id: str
    budget_s: float
    curve: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds since the flow was called, policy version, greedy held-out accuracy)."""
    lengths: dict[int, float] = field(default_factory=dict)
    """Mean greedy response length (tokens) per scored version."""
    by_terms: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per scored version, greedy held-out reward per term-count bucket (`eval/reward_terms_*`)."""
    step_time_s: float | None = None
    """Mean `train/step_time_s` over the run."""
    wall_s: float | None = None
    stopped_by: str | None = None
    """What ended training: ``trainer.total_steps`` (steps done, budget left) or the time budget."""
    error: str | None = None
    before: float | None = None
    """With `model.supervised`, version 0 is the model after the run's supervised pass:
    this is the greedy accuracy of the model given in `model.path`, the run's start."""

    def within(self) -> list[tuple[float, int, float]]:
        return [point for point in self.curve if point[0] <= self.budget_s]

    @property
    def start(self) -> float | None:
        if self.before is not None:
            return self.before
        return next((acc for _, v, acc in self.curve if v == 0), None)

    @property
    def peak(self) -> float | None:
        return max((acc for _, _, acc in self.within()), default=None)

    @property
    def final(self) -> float | None:
        inside = self.within()
        return max(inside, key=lambda p: p[1])[2] if inside else None

    @property
    def steps(self) -> int | None:
        inside = self.within()
        return max(v for _, v, _ in inside) if inside else None

    @property
    def hold(self) -> float | None:
        """Mean accuracy of the versions committed in the last third of the budget."""
        late = [acc for at_s, v, acc in self.within() if v > 0 and at_s >= self.budget_s * 2 / 3]
        return sum(late) / len(late) if late else None

    def gain(self, value: float | None) -> float | None:
        start = self.start
        return None if value is None or start is None else value - start

    def holds(self, target: float) -> bool:
        final, hold = self.gain(self.final), self.gain(self.hold)
        return final is not None and hold is not None and final >= target and hold >= target


def _fmt(value: float | None, spec: str = ".3f", sign: bool = False) -> str:
    if value is None:
        return "-"
    return format(value, ("+" if sign else "") + spec)


def curve_text(run: RecipeRun) -> str:
    """One line per scored version: minute, version, accuracy, response length."""
    lines = [
        f"seed {run.seed} ({run.run_id}): minute, version, greedy accuracy, length, "
        "greedy reward by term count"
    ]
    for at_s, version, acc in sorted(run.curve, key=lambda p: p[1]):
        late = "" if at_s <= run.budget_s else "  (after the budget)"
        length = _fmt(run.lengths.get(version), ".1f")
        sizes = "  ".join(
            f"{key.removeprefix('eval/reward_')} {value:.3f}"
            for key, value in sorted(run.by_terms.get(version, {}).items())
        )
        lines.append(f"  {at_s / 60:6.1f}  v{version:<4d} {acc:.3f}  {length}  {sizes}{late}")
    return "\n".join(lines)


def runs_table(runs: Sequence[RecipeRun], target: float) -> str:
    lines = [
        "| seed | steps | s / step | start | peak | final | hold (last third) "
        f"| Δ final | Δ hold | holds +{target:.2f} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if r.error:
            lines.append(f"| {r.seed} | failed: {r.error} |||||||||")
            continue
        lines.append(
            f"| {r.seed} | {r.steps} | {_fmt(r.step_time_s, '.2f')} | {_fmt(r.start)} "
            f"| {_fmt(r.peak)} | {_fmt(r.final)} | {_fmt(r.hold)} "
            f"| {_fmt(r.gain(r.final), '.3f', True)} | {_fmt(r.gain(r.hold), '.3f', True)} "
            f"| {'yes' if r.holds(target) else 'no'} |"
        )
    done = [r for r in runs if not r.error]
    if len(done) > 1:

        def over(values: list[float | None], spec: str = ".3f") -> str:
            return mean_std([v for v in values if v is not None]).format(spec)

        lines.append(
            f"| mean ± std | {over([r.steps for r in done], '.1f')} "
            f"| {over([r.step_time_s for r in done], '.2f')} | {over([r.start for r in done])} "
            f"| {over([r.peak for r in done])} | {over([r.final for r in done])} "
            f"| {over([r.hold for r in done])} | {over([r.gain(r.final) for r in done])} "
            f"| {over([r.gain(r.hold) for r in done])} "
            f"| {sum(r.holds(target) for r in done)} of {len(done)} |"
        )
    return "\n".join(lines)


def report_text(runs: Sequence[RecipeRun], target: float, header: str = "") -> str:
    parts = [header] if header else []
    parts += [curve_text(r) for r in runs if not r.error]
    parts.append(runs_table(runs, target))
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------- the runs


def score_run(scoring: Any, run: RecipeRun, started_at: float) -> None:
    """Score every version the run kept, deleting each checkpoint once scored; version 0
    goes last, since a LoRA run's later versions are adapters over it."""
    from sluice.infra.checkpoints import delete_checkpoint
    from sluice.tasks.evaluate.role import evaluate_checkpoint
    from sluice.tasks.run.paths import run_registry

    registry = run_registry(scoring, run.run_id)
    kept = [committed for committed in registry.versions() if not committed.deleted]
    for committed in kept:
        at_s = committed.created_at_ms / 1000.0 - started_at
        metrics = evaluate_checkpoint(
            scoring, run.run_id, committed.policy_version, committed.checkpoint_uri
        )
        run.curve.append((at_s, committed.policy_version, metrics["eval/greedy_accuracy"]))
        run.lengths[committed.policy_version] = metrics["eval/response_length_mean"]
        run.by_terms[committed.policy_version] = {
            key: value for key, value in metrics.items() if key.startswith("eval/reward_terms_")
        }
        print(f"  v{committed.policy_version} at {at_s / 60:.1f} min: {run.curve[-1][2]:.3f}")
        if committed.policy_version:
            delete_checkpoint(committed.checkpoint_uri, scoring.storage.options)
            registry.mark_deleted(committed.policy_version)
    base = next((committed for committed in kept if committed.policy_version == 0), None)
    if base is not None:
        delete_checkpoint(base.checkpoint_uri, scoring.storage.options)
        registry.mark_deleted(0)


def run_seed(
    base: Any, scoring: Any, seed: int, label: str, before: float | None = None
) -> RecipeRun:
    import shutil

    from sluice.flows.bench.async_vs_sync import with_settings
    from sluice.flows.train import train
    from sluice.infra.checkpoints import delete_checkpoint
    from sluice.infra.tracking import get_metric_history
    from sluice.tasks.evaluate.role import eval_weights_dir
    from sluice.tasks.run.paths import run_paths

    name = f"recipe-{label}-s{seed}"
    config = with_settings(base, {"seed": seed, "name": name})
    run = RecipeRun(seed, name, config.trainer.time_budget_s, before=before)
    print(f"--- seed {seed} (run {name}) ---", flush=True)
    started_at, started = time.time(), time.monotonic()
    try:
        outcome = train(config, run_id=name)
        run.wall_s = time.monotonic() - started
        steps = get_metric_history(
            config.tracking.uri, outcome["mlflow_run_id"], "train/step_time_s"
        )
        run.step_time_s = sum(v for _, v in steps) / len(steps) if steps else None
        total = config.trainer.total_steps
        run.stopped_by = "trainer.total_steps" if len(steps) >= total else "the time budget"
        print(
            f"  training stopped by {run.stopped_by}: {len(steps)} of {total} steps; the "
            f"flow took {run.wall_s / 60:.1f} min (budget {run.budget_s / 60:.1f} min)",
            flush=True,
        )
        score_run(with_settings(scoring, {"name": name}), run, started_at)
    except Exception as err:  # one crashed run must not cost the other seeds
        run.wall_s = run.wall_s or time.monotonic() - started
        run.error = f"{type(err).__name__}: {err}"[:300]
        print(f"seed {seed} failed: {run.error}", flush=True)
    for local in (Path(config.workdir) / "runs" / name / "trainer", eval_weights_dir(config, name)):
        shutil.rmtree(local, ignore_errors=True)
    newest = max((v for _, v, _ in run.curve), default=None)
    if newest is not None:  # only the newest version's trainer state is kept (~1 GB)
        delete_checkpoint(run_paths(config, name).trainer_state(newest), config.storage.options)
    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model-path", required=True, help="a local HF model directory")
    parser.add_argument("--config", default=CONFIG, help="run config (name or path)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds: seed, seed+1, ...")
    parser.add_argument("--minutes", type=float, default=30.0, help="wall time per run")
    parser.add_argument("--every", type=int, default=5, help="score every N-th version")
    parser.add_argument("--target", type=float, default=0.15, help="gain a run must hold")
    parser.add_argument("--label", default="recipe", help="names the runs and the report")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", help="JSON of every row (default .sluice/bench/recipe-LABEL.json)")
    parser.add_argument(
        "--ceiling",
        type=int,
        default=0,
        metavar="K",
        help="train nothing: the start policy's pass@1 and pass@K at the rollout temperature",
    )
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """The validated config of every run and the scoring config; raises ConfigError."""
    from sluice.flows.bench.async_vs_sync import with_settings
    from sluice.infra.config.overrides import ConfigError
    from sluice.infra.config.run import load_config

    if args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    if not args.minutes > 0:
        raise ConfigError(f"--minutes must be > 0, got {args.minutes}")
    if args.every < 1:
        raise ConfigError(f"--every must be >= 1, got {args.every}")
    if not (Path(args.model_path) / "config.json").is_file():
        raise ConfigError(f"--model-path {args.model_path} is not a Hugging Face model directory")
    explicit = {o.partition("=")[0].strip() for o in args.overrides}
    for key, why in SET_BY_BENCH.items():
        if key in explicit:
            raise ConfigError(f"bench_recipe sets {key} itself ({why}); drop --set {key}")
    settings = [
        f"model.path={Path(args.model_path).resolve()}",
        *(f"{key}={value}" for key, value in BENCH_DEFAULTS.items()),
        f"trainer.time_budget_s={args.minutes * 60}",
        f"evaluation.every={args.every}",
    ]
    config = load_config(args.config, [*settings, *args.overrides])
    if not config.storage.keep_versions:
        raise ConfigError("storage.keep_versions=0 keeps every version: ~0.5 GB each at 135M")
    # Scoring: greedy decoding, the same prompts for every version of every run.
    scoring = with_settings(config, {"seed": 0, "evaluation.temperature": 0.0})
    return config, scoring


def print_ceiling(config: Any, k: int) -> None:
    """The start policy's pass@1 and pass@k on the held-out prompts, by term count."""
    from sluice.flows.bench.async_vs_sync import with_settings
    from sluice.tasks.evaluate.role import evaluate_model_dir

    sampling = with_settings(
        config,
        {
            "seed": 0,
            "evaluation.samples": k,
            "evaluation.pass_at_k": [1, k],
            "evaluation.greedy": False,
            "evaluation.temperature": None,
        },
    )
    started = time.monotonic()
    metrics = evaluate_model_dir(sampling, Path(str(config.model.path)), 0)
    print(
        f"start policy `{config.model.path}`, {sampling.evaluation.num_prompts} held-out "
        f"prompts x {k} samples at temperature {config.rollout.temperature} "
        f"({time.monotonic() - started:.0f} s):"
    )
    for key, value in sorted(metrics.items()):
        if key.startswith(("eval/pass_at_", "eval/reward")):
            print(f"  {key.removeprefix('eval/')} {value:.3f}")


def main(argv: list[str] | None = None) -> None:
    import torch

    from sluice.tasks.evaluate.role import evaluate_model_dir

    args = parse_args(argv)
    config, scoring = build_config(args)
    if args.ceiling:
        print_ceiling(config, args.ceiling)
        return
    tag = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = args.out or f".sluice/bench/recipe-{args.label}-{tag}.json"
    start = evaluate_model_dir(scoring, Path(str(config.model.path)), 0)
    print(
        "start policy, greedy held-out: "
        + ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in sorted(start.items())),
        flush=True,
    )
    header = (
        f"# bench_recipe {args.label} ({tag} UTC)\n\n"
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}, torch {torch.__version__}; config {args.config} "
        f"{' '.join(args.overrides) or '(as shipped)'}; model `{config.model.path}`; "
        f"{config.trainer.time_budget_s:g} s per run (start-up included); held-out: "
        f"{scoring.evaluation.num_prompts} prompts, greedy, every {args.every}th version "
        f"scored after the run; hold = mean over versions committed in the last third"
    )
    runs: list[RecipeRun] = []
    for index in range(args.seeds):
        before = start["eval/greedy_accuracy"] if config.model.supervised.minutes else None
        runs.append(run_seed(config, scoring, config.seed + index, args.label, before))
        report = report_text(runs, args.target, header)
        data = {
            "label": args.label,
            "config": args.config,
            "overrides": args.overrides,
            "target": args.target,
            "runs": [
                {**asdict(r), "start": r.start, "peak": r.peak, "final": r.final, "hold": r.hold}
                for r in runs
            ],
            "base_config": config.model_dump(mode="json"),
        }
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str))
        path.with_suffix(".md").write_text(report)
        print(report, flush=True)


if __name__ == "__main__":
    main()
