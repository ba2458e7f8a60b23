"""The arguments of `sluice plan` (argparse only: `sluice --help` imports nothing heavy)."""

from __future__ import annotations

from typing import Any

DEFAULT_ETAS = (0, 1, 2, 4, 8)


def add_plan_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan", help="recommend the rollout:train split, η and batch size (simulated)"
    )
    plan.add_argument("config", nargs="?", default="default", help="config that locates the runs")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument(
        "--from-run",
        dest="runs",
        action="append",
        default=[],
        metavar="RUN",
        help="calibrate from this run under the config's workdir (repeatable)",
    )
    plan.add_argument(
        "--hardware", metavar="GPU", help="plan from datasheet figures: h100, h800, h200, h20, a100"
    )
    plan.add_argument(
        "--model", metavar="NAME", help="with --hardware: qwen2.5-1.5b, -7b, -14b, -32b"
    )
    plan.add_argument(
        "--devices", type=int, metavar="N", help="devices to plan for (default: the run's)"
    )
    plan.add_argument(
        "--eta",
        dest="etas",
        action="append",
        type=int,
        metavar="E",
        help=f"staleness bounds to try (repeatable; default {' '.join(map(str, DEFAULT_ETAS))})",
    )
    plan.add_argument(
        "--batch",
        dest="batches",
        action="append",
        type=int,
        metavar="B",
        help="prompt groups per step to try (repeatable; default the run's or config's)",
    )
    plan.add_argument("--staleness-cap", type=int, metavar="E", help="recommend only η <= E")
    plan.add_argument(
        "--group-size", type=int, metavar="G", help="with --hardware: samples per prompt"
    )
    plan.add_argument(
        "--response-mean",
        type=float,
        default=8000.0,
        metavar="T",
        help="with --hardware: mean response tokens (lognormal; default 8000)",
    )
    plan.add_argument(
        "--response-sigma",
        type=float,
        default=0.8,
        metavar="S",
        help="with --hardware: lognormal sigma of response lengths (default 0.8)",
    )
    plan.add_argument("--max-new-tokens", type=int, metavar="T", help="cap on response tokens")
    plan.add_argument(
        "--prompt-tokens",
        type=int,
        default=300,
        metavar="T",
        help="with --hardware: prompt tokens (default 300)",
    )
    plan.add_argument(
        "--tp", type=int, default=1, metavar="K", help="with --hardware: GPUs per inference server"
    )
    plan.add_argument("--steps", type=int, default=20, help="simulated train steps per candidate")
    plan.add_argument(
        "--validate",
        action="store_true",
        help="print the validation tables (own CPU runs, published results)",
    )
    plan.add_argument(
        "--horizon",
        type=float,
        default=60.0,
        metavar="S",
        help="--validate: wall seconds per CPU run (default 60)",
    )
