"""The warm-started policy that ships with Sluice, and the script that rebuilds it.

`sluice train` with the embedded default must reach RL within seconds, so the tiny
policy's supervised warm start is not run on the user's clock: its result ships as a
~3.5 MB Hugging Face directory in ``engines/policy/policies/``. This module rebuilds that
directory byte for byte from its seed and records what it is:

    python -m sluice.engines.policy.shipped_policy build     # retrain it (~8 min on one core) and compare
    python -m sluice.engines.policy.shipped_policy verify    # hash the shipped files against SHA256SUMS

Byte-for-byte needs the same arithmetic: the build pins torch to one intra-op thread
(a different thread count changes the order of float reductions), fixes every seed, and
trains for a fixed number of steps rather than until an accuracy check passes, so no
evaluation sits on the path from seed to bytes. Same torch build and CPU give the same
bytes; `SHA256SUMS` records them. Another CPU does not: torch picks its vectorised
kernels (AVX2, AVX-512, none) and MKL its GEMM code by CPU, and each rounds differently.
So the first steps of a rebuild are checked two ways (tests/unit/test_shipped_policy.py):
bit for bit against `PREFIX_CHECK_SHA256` on the machine that recorded it
(`PREFIX_CHECK_MACHINE`), and everywhere against `PREFIX_CHECK_FINGERPRINT`, float64
norms of a few weight tensors and the mean loss, within `PREFIX_CHECK_RTOL`:

    python -m sluice.engines.policy.shipped_policy prefix    # this machine's key, digest, fingerprint

What it is: 2,100 supervised steps on the built-in task's warm-start corpus, which
mixes worked running sums with bare answers (engines/env/problems/longtail.py). The policy blurts a
bare answer about 60% of the time (right ~6% of the time) and works the sum out the
rest (right ~26%), so RL has a strategy to discover and a long way to climb. The step
count was chosen by running RL from snapshots along one warm-start run; the
measurements are in docs/reports/2026-11-24-default-run.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "policies" / "longtail_sum-llama-0.9m"
"""Where the shipped warm-started policy lives (an ordinary Hugging Face directory)."""
DIGEST_FILE = "SHA256SUMS"
"""sha256 of every shipped file, in `sha256sum` format, so `sha256sum -c` checks it too."""
BUILD_FILE = "sluice_build.json"
"""The recipe the directory was made with (`ShippedBuild` fields) and what the warm start
measured: its loss curve and the greedy held-out accuracy of the saved weights. Timings
and paths are left out: they differ from build to build, the bytes must not."""


@dataclass(frozen=True)
class ShippedBuild:
    """Everything that determines the shipped policy's bytes."""

    arch: str = "llama"
    """Hugging Face architecture of the tiny model."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    intermediate_size: int = 384
    """MLP width."""
    max_position_embeddings: int = 512
    """Longest prompt + response, in tokens."""
    problem: str = "longtail_sum"
    """Built-in task it was warm-started on."""
    seed: int = 0
    """Seeds initialisation, supervised rows and the optimiser."""
    steps: int = 2100
    """Supervised optimizer steps (fixed: no accuracy check decides where the bytes end)."""
    lr: float = 2e-3
    """AdamW learning rate of the warm start."""
    batch_size: int = 16
    """Supervised rows per step."""
    weight_average_decay: float = 0.98
    """The saved weights are this exponential moving average of the trained ones."""
    threads: int = 1
    """torch intra-op threads during the build (part of what fixes the arithmetic)."""

    def tiny_shape(self) -> dict[str, int | str]:
        """The `model.tiny` config section this policy has."""
        return {
            "arch": self.arch,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
        }


BUILD = ShippedBuild()
"""The recipe of the policy in SHIPPED_DIR."""

PREFIX_CHECK_STEPS = 40
"""Steps of the short rebuild a unit test runs to check the build is still deterministic."""
PREFIX_CHECK_MACHINE = "x86_64 AMD EPYC | AVX2 | torch 2.13.0+cpu"
"""`machine_key()` of the machine that recorded PREFIX_CHECK_SHA256 (a 2-core AMD EPYC)."""
PREFIX_CHECK_SHA256 = "39ac79d91a27a2623e8dae0b455649fc6b7adb5555693750397995af91c2c0fb"
"""sha256 of model.safetensors after PREFIX_CHECK_STEPS steps of BUILD, one torch thread,
on PREFIX_CHECK_MACHINE. Another CPU or torch build rounds differently: other bytes."""
PREFIX_CHECK_FINGERPRINT: dict[str, float] = {
    "model.embed_tokens.weight": 4.236598418,
    "model.layers.0.self_attn.q_proj.weight": 2.904104019,
    "model.layers.0.mlp.down_proj.weight": 5.227732928,
    "model.layers.1.mlp.up_proj.weight": 4.908194689,
    "model.layers.2.self_attn.v_proj.weight": 2.703560748,
    "model.layers.3.self_attn.k_proj.weight": 2.845197717,
    "model.layers.3.mlp.gate_proj.weight": 4.755641701,
    "model.norm.weight": 11.76530674,
    "mean_loss": 3.132201028,
}
"""`prefix_fingerprint()` of the same 40-step weights: float64 L2 norms of tensors from
every layer and kind, and the mean supervised loss of the 40 steps."""
PREFIX_CHECK_RTOL = 1e-5
"""Relative tolerance of the fingerprint on any CPU. Measured on PREFIX_CHECK_MACHINE:
torch's scalar kernels (ATEN_CPU_CAPABILITY=default) or MKL's reproducible mode
(MKL_CBWR=COMPATIBLE) give other bytes and move these numbers by at most 2e-7, while
a 1% higher learning rate moves one of them by 4e-3 (the loss by 4e-4), and two
batches trading places or the data stream shifted by one batch move one by 7-8e-3."""


def machine_key() -> str:
    """What decides the bytes of a build besides the recipe: CPU model, the vectorised
    kernels torch chose for it (`torch.backends.cpu.get_cpu_capability()`) and torch."""
    import platform

    import torch

    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{platform.machine()} {model} | {capability} | torch {torch.__version__}"


def prefix_fingerprint(directory: str | Path) -> dict[str, float]:
    """The PREFIX_CHECK_FINGERPRINT quantities of the build in `directory`."""
    import numpy as np
    from safetensors.numpy import load_file

    weights = load_file(Path(directory) / "model.safetensors")
    out = {
        name: float(np.linalg.norm(weights[name].astype(np.float64).ravel()))
        for name in PREFIX_CHECK_FINGERPRINT
        if name != "mean_loss"
    }
    record = json.loads((Path(directory) / BUILD_FILE).read_text())
    losses = [loss for _, loss in record["loss_curve"]]
    out["mean_loss"] = float(np.mean(losses))
    return out


def file_digests(directory: str | Path) -> dict[str, str]:
    """sha256 of every regular file in `directory` except the digest file, by name."""
    root = Path(directory)
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.iterdir())
        if path.is_file() and path.name != DIGEST_FILE
    }


def recorded_digests(directory: str | Path = SHIPPED_DIR) -> dict[str, str]:
    """The digests written in `directory`/SHA256SUMS."""
    lines = (Path(directory) / DIGEST_FILE).read_text().splitlines()
    out = {}
    for line in lines:
        if line.strip():
            digest, _, name = line.partition("  ")
            out[name.strip()] = digest.strip()
    return out


def verify(directory: str | Path = SHIPPED_DIR) -> list[str]:
    """Names of files whose bytes differ from SHA256SUMS (missing or extra files included)."""
    recorded = recorded_digests(directory)
    actual = file_digests(directory)
    return sorted(
        name for name in set(recorded) | set(actual) if recorded.get(name) != actual.get(name)
    )


def _write_digests(directory: Path) -> None:
    lines = [f"{digest}  {name}" for name, digest in file_digests(directory).items()]
    (directory / DIGEST_FILE).write_text("\n".join(lines) + "\n")


def build(
    out_dir: str | Path,
    recipe: ShippedBuild = BUILD,
    *,
    steps: int | None = None,
    num_eval_prompts: int = 128,
    progress: Callable[[str], None] = print,
) -> Path:
    """Build the warm-started policy from its seed into `out_dir` (replaced if present).

    `steps` cuts the supervised pass short (the determinism check); the directory then
    holds the weights after that many steps. `num_eval_prompts` sizes the one greedy
    held-out check at the end, which reads the weights but never changes them.
    """
    import torch

    from sluice.engines.env.problems.registry import get_problem
    from sluice.engines.policy.model import build_tiny_policy
    from sluice.engines.policy.warmstart import WARM_START_MARKER, warm_start

    out = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="sluice-shipped-") as scratch:
            base = Path(scratch) / "init"
            build_tiny_policy(base, seed=recipe.seed, **recipe.tiny_shape())  # type: ignore[arg-type]
            if out.exists():
                shutil.rmtree(out)
            report = warm_start(
                base,
                get_problem(recipe.problem),
                out_dir=out,
                target_accuracy=None,
                steps=recipe.steps if steps is None else steps,
                lr=recipe.lr,
                batch_size=recipe.batch_size,
                seed=recipe.seed,
                weight_average_decay=recipe.weight_average_decay,
                num_eval_prompts=num_eval_prompts,
                progress=progress,
            )
    finally:
        torch.set_num_threads(threads)
    (out / WARM_START_MARKER).unlink()
    record = {
        "recipe": asdict(recipe),
        "steps": report.steps,
        "held_out_greedy_accuracy": report.final_accuracy,
        "loss_curve": report.loss_curve,
    }
    (out / BUILD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    _write_digests(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.engines.policy.shipped_policy", description=__doc__
    )
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build", help="rebuild the shipped policy and compare it byte for byte")
    make.add_argument("--out", default=None, help="build here instead of a temporary directory")
    make.add_argument(
        "--install", action="store_true", help="replace the shipped directory with the build"
    )
    sub.add_parser("verify", help="check the shipped files against SHA256SUMS")
    sub.add_parser(
        "prefix", help="build PREFIX_CHECK_STEPS steps; print machine key, digest, fingerprint"
    )
    args = parser.parse_args(argv)
    if args.command == "prefix":
        with tempfile.TemporaryDirectory(prefix="sluice-prefix-") as scratch:
            out = build(Path(scratch) / "prefix", steps=PREFIX_CHECK_STEPS, num_eval_prompts=4)
            print(f"machine: {machine_key()}")
            print(f"sha256: {file_digests(out)['model.safetensors']}")
            for name, value in prefix_fingerprint(out).items():
                print(f"{name}: {value:.10g}")
        return 0
    if args.command == "verify":
        bad = verify()
        print("shipped policy OK" if not bad else f"differs from SHA256SUMS: {', '.join(bad)}")
        return 1 if bad else 0
    with tempfile.TemporaryDirectory(prefix="sluice-build-") as scratch:
        out = Path(args.out) if args.out else Path(scratch) / SHIPPED_DIR.name
        build(out)
        built = file_digests(out)
        if args.install:
            if SHIPPED_DIR.exists():
                shutil.rmtree(SHIPPED_DIR)
            shutil.copytree(out, SHIPPED_DIR)
            print(f"installed {SHIPPED_DIR}")
            return 0
        shipped = file_digests(SHIPPED_DIR) if SHIPPED_DIR.exists() else {}
        differs = sorted(n for n in set(built) | set(shipped) if built.get(n) != shipped.get(n))
        for name, digest in built.items():
            print(f"{digest}  {name}  {'differs' if name in differs else 'same'}")
        print("rebuild matches the shipped policy byte for byte" if not differs else "MISMATCH")
        return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
