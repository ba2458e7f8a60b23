"""Benchmark: exact π_prox against log-linear π_prox on the real-model recipe, at equal wall time.

With `trainer.ppo_minibatches > 1` (the shipped `reasoning_gym` config has 2), the
decoupled loss needs log π_prox for the samples outside the first minibatch
(docs/design.md §1 "Three policies", §1.1 "Log-linear π_prox"):

- ``exact``: one no-grad forward pass over those samples (the first minibatch's own
  forward gives its tokens' π_prox for free);
- ``loglinear``: no pass; log π_prox interpolated between the behaviour and the current
  log-probs by policy version (AReaL's ``prox_logp_method: loglinear``).

For each seed (``seed``, ``seed+1``, ...) the script runs the config twice through the
real asynchronous ``train`` flow, one run per arm, the arm that runs first alternating
with the seed (exact first on even seed indices) so a machine that slows down over an
hour hurts neither arm more. Both runs of a seed share everything but
``trainer.loss.proximal``: the model (``--model-path``, version 0 of every run), the
seed, and ``trainer.time_budget_s = --minutes × 60`` (start-up included;
``trainer.total_steps`` is set out of reach so only the clock ends a run). Nothing is
evaluated while the clock runs (``evaluation.during_run=false``: every core goes to
rollout and training, as in the shipped config's own study).

Equal wall time is had from the registry's commit times, not from where a run stops:
when the budget runs out, the step in progress still finishes and is committed after
it (before the trainer learnt to stop at its next step, every batch already complete
was trained too, with the cores to itself). So a run's steps are the newest version committed within the budget since the flow was
called, its per-step means are over those steps only, and that version is the one
scored on the held-out prompts after the run, with the same sampling seeds as the start
policy (seed 0, no greedy pass: ``sluice bench time-to-target``'s scoring). Retention
keeps η + 3 versions so it is still there; then the run's checkpoints and trainer
state are deleted.

Per run, from its MLflow metrics over those steps: s / step = mean of
``train/step_time_s`` (the trainer's compute per step, its π_prox pass included; the
wall time per step is the budget over the steps); π_prox s / step = mean of
``train/proximal_time_s`` (the pass alone), and its
share = that mean over the s / step mean; π_prox pass tokens = mean of
``train/proximal_pass_tokens``; response tokens = mean of ``train/response_tokens``
(the batch's size varies as all-equal groups are dropped, and the step time with it);
k3 KL = mean of ``mismatch/kl_k3`` (KL(π_behav‖π_prox); the loglinear arm's is over the
first minibatch's samples only, the only ones whose π_prox is exact there); held-out
reward start, final and Δ = final − start.

Printed: a side-by-side table per seed, mean ± sample std per arm over seeds, and the
ratio exact / loglinear of s / step (and of steps) per seed: a ratio only ever divides
two runs of the same seed in this one invocation. Every row goes to ``--out`` (JSON, a
``.md`` of the printed report beside it), rewritten after each run so a stopped bench
keeps its rows. The Prefect API is the one ``sluice bench`` gets: ``PREFECT_API_URL``
when set, else a temporary local one started for this process.

Run (from the directory whose ``.sluice/`` should hold the runs)::

    python tests/benchmarks/bench_proximal.py --model-path DIR [--seeds 3] [--minutes 20] \\
        [--set key=value ...] [--out FILE.json]

A full run takes about 2 × seeds × (minutes + ~1.5) minutes: 2 h 10 min at the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sluice.flows.bench.study_stats import MeanStd, mean_std

ARMS: tuple[str, str] = ("exact", "loglinear")
CONFIG = "reasoning_gym"
BENCH_DEFAULTS: dict[str, Any] = {
    # Only the clock ends a run: the arm with the cheaper step must not stop at a cap.
    "trainer.total_steps": 100_000,
    "evaluation.during_run": False,
    # Retention keeps what the evaluation schedule would score: version 0 and the newest
    # few (`storage.keep_versions`, raised below), not every 10th of a long run.
    "evaluation.every": 0,
}
"""Settings every run takes unless `--set` names the key."""
SET_BY_BENCH: dict[str, str] = {
    "trainer.loss.proximal": "the bench runs both arms",
    "trainer.time_budget_s": "use --minutes",
    "model.path": "use --model-path",
    "name": "each run is named by the bench",
}
"""Keys each run gets from the bench itself; a --set of one would be overwritten."""


@dataclass
class ArmRun:
    """One run of one arm with one seed."""

    arm: str
    seed: int
    run_id: str
    position: int
    """1 when this arm ran first for its seed, 2 when second."""
    steps: int | None = None
    """The newest policy version committed within the time budget: the steps done."""
    step_time_s: float | None = None
    """Mean of `train/step_time_s` over those steps (as every mean below)."""
    proximal_time_s: float | None = None
    """Mean of `train/proximal_time_s`."""
    proximal_pass_tokens: float | None = None
    """Mean of `train/proximal_pass_tokens`."""
    response_tokens: float | None = None
    """Mean of `train/response_tokens`: the batch's size, which s / step follows."""
    kl_k3: float | None = None
    """Mean of `mismatch/kl_k3`."""
    held_out_start: float | None = None
    held_out_final: float | None = None
    """Held-out reward of version `steps`, the newest within the budget."""
    steps_total: int | None = None
    """The newest version committed at all: the run trains the batches complete when the
    budget ran out before it stops, so versions after `steps` came after the budget."""
    wall_s: float | None = None
    """Seconds of the train flow call (the budget plus shutdown), scoring excluded."""
    error: str | None = None

    @property
    def proximal_share(self) -> float | None:
        """Share of the mean step time spent getting π_prox."""
        if self.proximal_time_s is None or not self.step_time_s:
            return None
        return self.proximal_time_s / self.step_time_s

    @property
    def delta(self) -> float | None:
        if self.held_out_start is None or self.held_out_final is None:
            return None
        return self.held_out_final - self.held_out_start


# ---------------------------------------------------------------- pure: order, stats, tables


def newest_within(times: Sequence[tuple[int, float]], budget_s: float) -> int | None:
    """The newest version committed within `budget_s`; `times` is [(version, seconds
    since the run started)]."""
    return max((v for v, at_s in times if at_s <= budget_s), default=None)


def mean_through(history: Sequence[tuple[int, float]], last_step: int) -> float | None:
    """Mean of a metric's values at steps 1 .. `last_step` (a step's metrics are logged
    at the version it commits)."""
    kept = [value for step, value in history if step <= last_step]
    return sum(kept) / len(kept) if kept else None


def arm_order(seed_index: int) -> tuple[str, ...]:
    """The arms in the order seed number `seed_index` (0, 1, ...) runs them."""
    return ARMS if seed_index % 2 == 0 else ARMS[::-1]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _pair(runs: Sequence[ArmRun], seed: int) -> dict[str, ArmRun]:
    return {r.arm: r for r in runs if r.seed == seed and r.error is None}


def seed_ratios(runs: Sequence[ArmRun], seed: int) -> dict[str, float | None]:
    """exact / loglinear of s / step and of steps, for one seed's two runs."""
    pair = _pair(runs, seed)
    exact, loglinear = pair.get("exact"), pair.get("loglinear")
    if exact is None or loglinear is None:
        return {"step_time": None, "steps": None}
    steps = _ratio(
        None if exact.steps is None else float(exact.steps),
        None if loglinear.steps is None else float(loglinear.steps),
    )
    return {"step_time": _ratio(exact.step_time_s, loglinear.step_time_s), "steps": steps}


def arm_stats(runs: Sequence[ArmRun], arm: str) -> dict[str, MeanStd]:
    """Mean ± sample std over the seeds of one arm's runs that did not crash."""
    done = [r for r in runs if r.arm == arm and r.error is None]
    return {
        "steps": mean_std(None if r.steps is None else float(r.steps) for r in done),
        "step_time_s": mean_std(r.step_time_s for r in done),
        "proximal_time_s": mean_std(r.proximal_time_s for r in done),
        "proximal_share": mean_std(r.proximal_share for r in done),
        "proximal_pass_tokens": mean_std(r.proximal_pass_tokens for r in done),
        "response_tokens": mean_std(r.response_tokens for r in done),
        "kl_k3": mean_std(r.kl_k3 for r in done),
        "held_out_start": mean_std(r.held_out_start for r in done),
        "held_out_final": mean_std(r.held_out_final for r in done),
        "delta": mean_std(r.delta for r in done),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _pct_stats(stats: MeanStd) -> str:
    scaled = MeanStd(
        None if stats.mean is None else 100 * stats.mean,
        None if stats.std is None else 100 * stats.std,
        stats.n,
    )
    text = scaled.format(".1f")
    return text if text == "-" else f"{text}%"


def _after_budget(run: ArmRun) -> str:
    if run.steps is None or run.steps_total is None:
        return "-"
    return str(run.steps_total - run.steps)


def seed_table(runs: Sequence[ArmRun], seed: int) -> str:
    """Both arms of one seed side by side, one row per measure."""
    mine = {r.arm: r for r in runs if r.seed == seed}
    first = next((r.arm for r in mine.values() if r.position == 1), "?")
    ratios = seed_ratios(runs, seed)

    def cells(text_of: Any) -> str:
        texts = []
        for arm in ARMS:
            run = mine.get(arm)
            texts.append("-" if run is None else "failed" if run.error else text_of(run))
        return " | ".join(texts)

    rows = [
        ("steps in the budget", lambda r: _fmt(r.steps, "d"), _fmt(ratios["steps"], ".2f")),
        ("s / step", lambda r: _fmt(r.step_time_s, ".2f"), _fmt(ratios["step_time"], ".2f")),
        ("π_prox s / step", lambda r: _fmt(r.proximal_time_s, ".3f"), ""),
        ("π_prox share of step", lambda r: _pct(r.proximal_share), ""),
        ("π_prox pass tokens / step", lambda r: _fmt(r.proximal_pass_tokens, ".0f"), ""),
        ("response tokens / step", lambda r: _fmt(r.response_tokens, ".0f"), ""),
        ("k3 KL(π_behav‖π_prox)", lambda r: _fmt(r.kl_k3, ".2e"), ""),
        ("held-out start", lambda r: _fmt(r.held_out_start, ".3f"), ""),
        ("held-out final", lambda r: _fmt(r.held_out_final, ".3f"), ""),
        ("held-out Δ", lambda r: _fmt(r.delta, "+.3f"), ""),
        ("versions after the budget", lambda r: _after_budget(r), ""),
    ]
    lines = [
        f"seed {seed} ({first} ran first)",
        "",
        "| | exact | loglinear | exact / loglinear |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {cells(text_of)} | {ratio} |" for name, text_of, ratio in rows]
    return "\n".join(lines)


def summary_table(runs: Sequence[ArmRun]) -> str:
    """One row per arm: mean ± sample std over seeds."""
    lines = [
        "| arm | runs | steps | s / step | π_prox s / step | π_prox share | π_prox pass "
        "tokens / step | response tokens / step | k3 KL | held-out start | held-out final "
        "| held-out Δ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        mine = [r for r in runs if r.arm == arm]
        stats = arm_stats(runs, arm)
        done = sum(r.error is None for r in mine)
        lines.append(
            f"| {arm} | {done}/{len(mine)} | {stats['steps'].format('.1f')} "
            f"| {stats['step_time_s'].format('.2f')} | {stats['proximal_time_s'].format('.3f')} "
            f"| {_pct_stats(stats['proximal_share'])} "
            f"| {stats['proximal_pass_tokens'].format('.0f')} "
            f"| {stats['response_tokens'].format('.0f')} | {stats['kl_k3'].format('.2e')} "
            f"| {stats['held_out_start'].format('.3f')} | {stats['held_out_final'].format('.3f')} "
            f"| {stats['delta'].format('+.3f')} |"
        )
    return "\n".join(lines)


def seeds_in(runs: Sequence[ArmRun]) -> list[int]:
    return list(dict.fromkeys(r.seed for r in runs))


def ratio_table(runs: Sequence[ArmRun]) -> str:
    """exact / loglinear per seed (two runs of the same seed), then mean ± std of those."""
    lines = [
        "| seed | ran first | exact s / step | loglinear s / step | s / step exact / loglinear "
        "| steps exact / loglinear |",
        "|---|---|---|---|---|---|",
    ]
    step_ratios, steps_ratios = [], []
    for seed in seeds_in(runs):
        pair = _pair(runs, seed)
        first = next((r.arm for r in runs if r.seed == seed and r.position == 1), "?")
        ratios = seed_ratios(runs, seed)
        step_ratios.append(ratios["step_time"])
        steps_ratios.append(ratios["steps"])
        exact_s, loglinear_s = (pair[a].step_time_s if a in pair else None for a in ARMS)
        lines.append(
            f"| {seed} | {first} | {_fmt(exact_s, '.2f')} | {_fmt(loglinear_s, '.2f')} "
            f"| {_fmt(ratios['step_time'], '.3f')} | {_fmt(ratios['steps'], '.3f')} |"
        )
    lines.append(
        f"| mean ± std | | | | {mean_std(step_ratios).format('.3f')} "
        f"| {mean_std(steps_ratios).format('.3f')} |"
    )
    return "\n".join(lines)


def report_text(runs: Sequence[ArmRun], header: str = "") -> str:
    """The printed report: per-seed tables, the per-arm summary, the ratios, failures."""
    parts = [header] if header else []
    parts += [seed_table(runs, seed) for seed in seeds_in(runs)]
    parts += [
        "mean ± sample std over seeds (crashed runs left out):",
        summary_table(runs),
        "exact / loglinear, each seed's two runs divided:",
        ratio_table(runs),
    ]
    failed = [f"- {r.arm} seed {r.seed} ({r.run_id}): {r.error}" for r in runs if r.error]
    if failed:
        parts.append("failed runs:\n" + "\n".join(failed))
    return "\n\n".join(parts) + "\n"


def payload(runs: Sequence[ArmRun], meta: dict[str, Any]) -> dict[str, Any]:
    """What --out holds: every row, the per-arm statistics, the per-seed ratios."""

    def stats_dict(stats: dict[str, MeanStd]) -> dict[str, Any]:
        return {key: asdict(value) for key, value in stats.items()}

    return {
        **meta,
        "runs": [{**asdict(r), "proximal_share": r.proximal_share, "delta": r.delta} for r in runs],
        "arms": {arm: stats_dict(arm_stats(runs, arm)) for arm in ARMS},
        "ratios": {str(seed): seed_ratios(runs, seed) for seed in seeds_in(runs)},
    }


# ---------------------------------------------------------------- the runs


def collect(config: Any, run: ArmRun, mlflow_run: str, times: list[tuple[int, float]]) -> None:
    """Fill `run` from its MLflow metrics, over the steps committed within the budget:
    the ones after it trained what was generated before it, with no rollout beside them
    on the cores, so their step times would flatter the arm with more of them."""
    from sluice.infra.tracking import get_metric_history

    uri = config.tracking.uri
    run.steps_total = max((v for v, _ in times), default=None)
    run.steps = newest_within(times, config.trainer.time_budget_s)
    last = run.steps or 0

    def mean_of(key: str) -> float | None:
        return mean_through(get_metric_history(uri, mlflow_run, key), last)

    run.step_time_s = mean_of("train/step_time_s")
    run.proximal_time_s = mean_of("train/proximal_time_s")
    run.proximal_pass_tokens = mean_of("train/proximal_pass_tokens")
    run.response_tokens = mean_of("train/response_tokens")
    run.kl_k3 = mean_of("mismatch/kl_k3")


def free_disk(config: Any, run_id: str, version: int | None) -> None:
    """What a finished run of this bench leaves that nothing reads again (~2.7 GB for a
    135M model): the trainer's local working copy and its state for resuming."""
    import shutil

    from sluice.infra.checkpoints import delete_checkpoint
    from sluice.tasks.evaluate.role import eval_weights_dir
    from sluice.tasks.run.paths import run_paths

    for local in (
        Path(config.workdir) / "runs" / run_id / "trainer",
        eval_weights_dir(config, run_id),
    ):
        shutil.rmtree(local, ignore_errors=True)
    if version is not None:
        state = run_paths(config, run_id).trainer_state(version)
        delete_checkpoint(state, config.storage.options)


def run_arm(base: Any, scoring: Any, arm: str, seed: int, position: int, tag: str) -> ArmRun:
    """One arm with one seed through the train flow, then the newest version committed
    within the budget scored."""
    from sluice.flows.bench.async_vs_sync import with_settings
    from sluice.flows.bench.time_to_target import ScoredRun
    from sluice.flows.train import train

    name = f"proximal-{tag}-{arm}-s{seed}"
    config = with_settings(base, {"trainer.loss.proximal": arm, "seed": seed, "name": name})
    run = ArmRun(arm, seed, name, position)
    print(f"--- seed {seed}, {arm} (run {name}) ---", flush=True)
    started_at, started = time.time(), time.monotonic()
    try:
        outcome = train(config, run_id=name)
        run.wall_s = time.monotonic() - started
        # The clock has stopped: scoring is not timed. Every version of every run is
        # scored with the same prompts and sampling seeds (`scoring`).
        scored = ScoredRun(scoring, name, started_at)
        times = scored.version_times()
        collect(config, run, outcome["mlflow_run_id"], times)
        run.held_out_final = scored.score(run.steps or 0)
    except Exception as err:  # one crashed run must not cost the other cells
        run.wall_s = run.wall_s or time.monotonic() - started
        run.error = f"{type(err).__name__}: {err}"[:300]
        print(f"{arm} seed {seed} failed: {run.error}", flush=True)
        return run
    try:
        scored.release()
        free_disk(config, name, run.steps_total)
    except Exception as err:  # the numbers stand; the disk keeps what it could not free
        print(f"{name}: could not delete its checkpoints ({err})", flush=True)
    return run


def bench_proximal(config: Any, seeds: int, out: str, tag: str) -> list[dict[str, Any]]:
    """Every seed × both arms, the report rewritten after each run."""
    import torch

    from sluice.flows.bench.time_to_target import eval_config
    from sluice.tasks.evaluate.role import evaluate_model_dir

    scoring = eval_config(config)
    start = evaluate_model_dir(scoring, Path(str(config.model.path)), 0)["eval/reward"]
    print(f"start policy held-out reward {start:.3f}", flush=True)

    budget = config.trainer.time_budget_s
    header = (
        f"# bench_proximal ({tag} UTC): exact vs log-linear π_prox\n\n"
        f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} "
        f"cores, python {platform.python_version()}, "
        f"torch {torch.__version__}; config {CONFIG}, model `{config.model.path}`; "
        f"{budget:g} s per run (start-up included), ppo_minibatches "
        f"{config.trainer.ppo_minibatches}, B {config.trainer.prompts_per_batch} × G "
        f"{config.rollout.group_size}, η {config.staleness.max_staleness}; held-out: "
        f"{scoring.evaluation.num_prompts} prompts × {scoring.evaluation.samples} sample(s), "
        "scored after each run\n\n"
        "steps = the newest version committed within the budget (every mean is over "
        "those steps; the held-out final is that version's); s / step = mean "
        "train/step_time_s (trainer compute); π_prox share = mean "
        "proximal_time_s / mean step_time_s; k3 KL = mean mismatch/kl_k3 (loglinear: first "
        "minibatch only)"
    )
    meta = {
        "tag": tag,
        "config": CONFIG,
        "machine": platform.platform(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "model_path": config.model.path,
        "time_budget_s": budget,
        "seeds": [config.seed + k for k in range(seeds)],
        "held_out_start": start,
        "base_config": config.model_dump(mode="json"),
    }
    runs: list[ArmRun] = []
    for index in range(seeds):
        seed = config.seed + index
        for position, arm in enumerate(arm_order(index), start=1):
            run = run_arm(config, scoring, arm, seed, position, tag)
            run.held_out_start = start
            runs.append(run)
            report = report_text(runs, header)
            write_out(out, report, payload(runs, meta))
            print(report, flush=True)
    return [asdict(r) for r in runs]


def write_out(out: str, report: str, data: dict[str, Any]) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    path.with_suffix(".md").write_text(report)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model-path", required=True, help="a local HF model directory")
    parser.add_argument("--seeds", type=int, default=3, help="seeds: seed, seed+1, ...")
    parser.add_argument("--minutes", type=float, default=20.0, help="wall time per run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", help="JSON of every row (default .sluice/bench/proximal-TAG.json)")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> Any:
    """The validated base config of every run; raises ConfigError with one line."""
    from sluice.infra.config.overrides import ConfigError
    from sluice.infra.config.run import load_config

    if args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    if not args.minutes > 0:
        raise ConfigError(f"--minutes must be > 0, got {args.minutes}")
    if not (Path(args.model_path) / "config.json").is_file():
        raise ConfigError(f"--model-path {args.model_path} is not a Hugging Face model directory")
    explicit = {o.partition("=")[0].strip() for o in args.overrides}
    for key, why in SET_BY_BENCH.items():
        if key in explicit:
            raise ConfigError(f"bench_proximal sets {key} itself ({why}); drop --set {key}")
    # The bench's settings come first, so an explicit --set of the same key wins.
    settings = [
        f"model.path={Path(args.model_path).resolve()}",
        *(f"{key}={value}" for key, value in BENCH_DEFAULTS.items()),
        f"trainer.time_budget_s={args.minutes * 60}",
    ]
    config = load_config(CONFIG, [*settings, *args.overrides])
    if "storage.keep_versions" not in explicit:
        # The version scored is the newest within the budget; up to η + 1 complete batches
        # and the step in flight are trained after it, so keep that many more.
        keep = max(3, config.staleness.max_staleness + 3)
        config = load_config(CONFIG, [*settings, f"storage.keep_versions={keep}", *args.overrides])
    if config.trainer.ppo_minibatches < 2:
        raise ConfigError(
            "with trainer.ppo_minibatches=1 both arms run no π_prox pass; the bench needs 2+"
        )
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from sluice.flows.cli import QUIET_ENV
    from sluice.infra.config.overrides import ConfigError

    try:
        config = build_config(args)
    except ConfigError as err:
        print(f"bench_proximal: error: {err}", file=sys.stderr)
        return 2
    for key, value in QUIET_ENV.items():  # what `sluice bench` sets before Prefect starts
        os.environ.setdefault(key, value)
    from prefect import flow

    from sluice.flows.bench.async_vs_sync import bench_tag

    tag = bench_tag()
    out = args.out or str(Path(config.workdir) / "bench" / f"proximal-{tag}.json")
    # A flow like `sluice bench`'s: the runs are its subflows, on the same Prefect API.
    bench = flow(name="sluice-bench-proximal", log_prints=True)(bench_proximal)
    bench(config, args.seeds, out, tag)
    print(f"rows: {out} (report: {Path(out).with_suffix('.md')})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
