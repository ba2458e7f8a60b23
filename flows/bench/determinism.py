"""`sluice bench determinism`: two seeded synchronous runs must log the same numbers, bit for bit.

The guarantee, which lets a refactor meant to change nothing prove it by reproducing
the seeded numbers exactly: two `train_sync` runs of one config and seed, from
the same initial policy, on the same machine with the same torch thread count, log
identical float64 values of `loss/policy_loss`, `train/grad_norm` and `reward/mean` at
every step, and end on byte-identical weights. What makes that hold:

- prompts are drawn from ``default_rng([seed, group index])``; every response samples
  from a counter-based generator keyed by its own seed (engines/inference/rng.py), so a
  token never depends on scheduling or on what else is batched;
- the tiny policy is initialised under ``torch.manual_seed(seed)``, and both runs load
  version 0 from the same cache in ``workdir/models`` (the warm start stops on a wall
  clock budget, so only a cached one is reproducible; never compare across workdirs);
- the trainer's minibatch split uses its own seeded generator; nothing reads torch's
  global RNG (no dropout in the model), so unseeded global state cannot leak in;
- the weight reload goes through float32 safetensors the trainer wrote, an exact copy;
- the thread count is pinned in the config both runs share (`threads_per_role`): torch
  splits float reductions and matmuls by its intra-op thread count, so 1 and 2 threads
  give losses that differ in the last bits (seen: 0.21109851449728012 against
  0.21109851822257042 on the same batch);
- a restarted or Prefect-retried trainer continues its minibatch RNG from the checkpoint
  (engines/rl/trainer.py) instead of re-seeding it.

The threading environment (OMP_* and MKL_* variables such as MKL_DYNAMIC or MKL_CBWR)
must be the same for both runs too.

Outside the guarantee: other machines, CPU instruction sets or library versions, CUDA
(its kernels are not bitwise deterministic by default), and verifiers with a wall-clock
guard (`math`, `code`) when a verification runs into its timeout. Timings such as
`train/wall_time_s` differ by nature and are not compared.
"""

from __future__ import annotations

import struct
from datetime import UTC, datetime
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from sluice.infra.checkpoints import read_manifest
from sluice.infra.config.run import RunConfig
from sluice.infra.tracking import get_metric_history
from sluice.tasks.run.paths import run_registry
from sluice.tasks.run.threads import role_threads

COMPARED_METRICS = ("loss/policy_loss", "train/grad_norm", "reward/mean")
DEFAULT_STEPS = 5
# Held-out evaluation takes CPU from the runs and proves nothing here: v0 and the final
# version only, unless the user sets it.
CHECK_DEFAULTS: dict[str, Any] = {"evaluation.every": 0}

History = dict[str, list[tuple[int, float]]]


def pinned_config(config: RunConfig, steps: int) -> RunConfig:
    """The config both runs share: `steps` long, with the sync role's thread count explicit.

    `threads_per_role=None` resolves from the machine's core count inside each role
    process; writing the resolved number into the config makes both runs use it and
    records it in the MLflow params of each.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    pinned = config.model_copy(deep=True)
    pinned.trainer.total_steps = steps
    if pinned.threads_per_role is None:
        pinned.threads_per_role = role_threads(pinned, "sync")
    return pinned


def weights_fingerprint(config: RunConfig, run_id: str, policy_version: int) -> tuple | None:
    """(file, sha256) of the weight files of one committed version, from its manifest."""
    committed = run_registry(config, run_id).get(policy_version)
    if committed is None:
        return None
    manifest = read_manifest(committed.checkpoint_uri, config.storage.options)
    return tuple(
        (entry.name, entry.sha256)
        for entry in manifest.files
        if entry.name.endswith((".safetensors", ".bin"))
    )


def run_sync(config: RunConfig, run_id: str) -> dict[str, Any]:
    """One synchronous run; returns its ids, compared metric histories and weight digests."""
    from sluice.flows.train_sync import train_sync

    result = train_sync(config, run_id=run_id)
    mlflow_run_id = result["mlflow_run_id"]
    histories: History = {
        key: get_metric_history(config.tracking.uri, mlflow_run_id, key) for key in COMPARED_METRICS
    }
    return {
        "run_id": run_id,
        "mlflow_run_id": mlflow_run_id,
        "seed": config.seed,
        "threads": config.threads_per_role,
        "histories": histories,
        "initial_weights": weights_fingerprint(config, run_id, 0),
        "final_weights": weights_fingerprint(config, run_id, config.trainer.total_steps),
    }


def bit_identical(a: float | None, b: float | None) -> bool:
    """Same IEEE-754 float64 bits (so 0.0 and -0.0 differ, and a missing value never matches)."""
    if a is None or b is None:
        return False
    return struct.pack("<d", a) == struct.pack("<d", b)


def compare_histories(first: History, second: History) -> list[dict[str, Any]]:
    """One row per (step, metric) over the steps either run logged."""
    rows = []
    steps = sorted(
        {step for history in (first, second) for values in history.values() for step, _ in values}
    )
    for step in steps:
        for key in COMPARED_METRICS:
            a = dict(first.get(key, [])).get(step)
            b = dict(second.get(key, [])).get(step)
            rows.append(
                {"step": step, "metric": key, "a": a, "b": b, "identical": bit_identical(a, b)}
            )
    return rows


def format_table(rows: list[dict[str, Any]], labels: tuple[str, str]) -> str:
    """Markdown table, values printed with repr() so every bit that differs shows."""
    lines = [
        f"| step | metric | {labels[0]} | {labels[1]} | bit-identical |",
        "|---|---|---|---|---|",
    ]
    previous = None
    for row in rows:
        step = str(row["step"]) if row["step"] != previous else ""
        previous = row["step"]
        a = "-" if row["a"] is None else repr(row["a"])
        b = "-" if row["b"] is None else repr(row["b"])
        lines.append(
            f"| {step} | {row['metric']} | {a} | {b} | {'yes' if row['identical'] else 'NO'} |"
        )
    return "\n".join(lines)


@flow(name="sluice-determinism", log_prints=True)
def determinism_check(config: RunConfig, steps: int = DEFAULT_STEPS) -> dict[str, Any]:
    """Run the synchronous loop twice with one seed; report whether every step matched.

    Both runs share the workdir (so version 0 comes from the same cached policy) and the
    tracking URI, under separate run ids. `matched` is true only when both ran every
    step, every compared metric is bit-identical at every step, and both runs started
    from and ended on byte-identical weights.
    """
    pinned = pinned_config(config, steps)
    tag = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    runs = [run_sync(pinned, f"{pinned.name}-determinism-{tag}-{label}") for label in "ab"]
    first, second = runs
    rows = compare_histories(first["histories"], second["histories"])
    logged_steps = sorted({row["step"] for row in rows})
    initial_identical = first["initial_weights"] is not None and (
        first["initial_weights"] == second["initial_weights"]
    )
    final_identical = first["final_weights"] is not None and (
        first["final_weights"] == second["final_weights"]
    )
    matched = (
        logged_steps == list(range(1, steps + 1))
        and all(row["identical"] for row in rows)
        and initial_identical
        and final_identical
    )
    # A policy that never sees a reward difference has zero advantages, zero loss and zero
    # gradient at every step: identical, and proving nothing about the trainer's numerics.
    vacuous = all(row["a"] == 0.0 for row in rows if row["metric"] == "loss/policy_loss")
    table = format_table(rows, (first["run_id"], second["run_id"]))
    report = (
        f"# sluice bench determinism ({tag} UTC)\n\n"
        f"seed {pinned.seed}, {steps} steps, {pinned.threads_per_role} torch threads, "
        f"B {pinned.trainer.prompts_per_batch} × G {pinned.rollout.group_size}\n\n"
        f"{table}\n\n"
        f"initial weights identical: {'yes' if initial_identical else 'NO'}; "
        f"final weights identical: {'yes' if final_identical else 'NO'}\n\n"
        f"**{'MATCHED' if matched else 'DIFFERED'}**: "
        + (
            "every step bit-identical"
            if matched
            else f"{sum(not r['identical'] for r in rows)} of {len(rows)} values differ"
            f" (steps logged: {logged_steps}, expected 1..{steps})"
        )
        + "\n"
        + (
            "\nwarning: every policy loss is 0.0 (no reward signal in any group), so this "
            "compared little more than sampling; warm-start the policy or use a verifier "
            "with graded rewards\n"
            if vacuous
            else ""
        )
    )
    print("\n" + report, flush=True)
    create_markdown_artifact(report, key="determinism", description="seeded sync runs compared")
    return {
        "matched": matched,
        "steps": steps,
        "seed": pinned.seed,
        "threads": pinned.threads_per_role,
        "initial_weights_identical": initial_identical,
        "final_weights_identical": final_identical,
        "vacuous": vacuous,
        "rows": rows,
        "runs": runs,
    }


def apply_check_defaults(config: RunConfig, overrides: list[str]) -> RunConfig:
    """Check-sized settings unless the user set them explicitly."""
    explicit = {o.partition("=")[0].strip() for o in overrides}
    config = config.model_copy(deep=True)
    for key, value in CHECK_DEFAULTS.items():
        if key in explicit:
            continue
        section, field = key.split(".")
        setattr(getattr(config, section), field, value)
    return config
