"""Sweep layouts through the simulator and pick one (pure compute).

The planner's question: on D devices, how many serve generation, which staleness
bound η, which batch size? :func:`async_layouts` enumerates the candidates (every
split in steps of one inference server, every η and batch size asked for),
:func:`sweep` simulates each, and :func:`recommend` picks:

- the highest trained tokens per second among candidates whose η is within the cap;
- among those within ``tolerance`` (2%) of it, the smallest η, then the smallest
  batch: fresher data and smaller batches cost learning nothing, so a 1% faster
  configuration that trains on older data is not worth recommending.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from sluice.engines.planner.costs import CostModel, Layout, Workload
from sluice.engines.planner.simulate import SimResult, simulate


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    result: SimResult

    @property
    def throughput(self) -> float:
        return self.result.trained_tokens_per_s


def async_layouts(
    base: Layout,
    *,
    etas: Sequence[int],
    batch_sizes: Sequence[int],
    splits: Sequence[int] | None = None,
    one_server: bool = False,
) -> list[Layout]:
    """Async layouts on ``base.devices``: every rollout device count that is a whole
    number of servers and leaves at least one train device (or ``splits``), × η ×
    batch size. η below ``publish_every - 1`` cannot make progress and is skipped.

    ``one_server``: the rollout devices form one server (Sluice's embedded server on a
    CPU, whose threads are the devices) instead of servers of ``devices_per_server``.
    """
    step = 1 if one_server else base.devices_per_server
    counts = list(splits) if splits is not None else list(range(step, base.devices, step))
    out = []
    for rollout in counts:
        for eta in etas:
            if eta < base.publish_every - 1:
                continue
            for batch in batch_sizes:
                out.append(
                    replace(
                        base,
                        mode="async",
                        rollout_devices=rollout,
                        devices_per_server=rollout if one_server else base.devices_per_server,
                        max_staleness=eta,
                        prompts_per_batch=batch,
                    )
                )
    return out


def sweep(
    workload: Workload,
    costs: CostModel | Callable[[Layout], CostModel],
    layouts: Iterable[Layout],
    *,
    steps: int = 20,
    warmup_steps: int = 3,
    seed: int = 0,
) -> list[Candidate]:
    """Simulate every layout with the same workload draws (same seed). `costs` may depend
    on the layout (``Calibration.costs_for``: costs measured on its device counts)."""
    cost_of = costs if callable(costs) else (lambda _layout: costs)
    return [
        Candidate(
            layout,
            simulate(
                workload,
                cost_of(layout),
                layout,
                steps=steps,
                warmup_steps=warmup_steps,
                seed=seed,
            ),
        )
        for layout in layouts
    ]


def recommend(
    candidates: Sequence[Candidate],
    *,
    staleness_cap: int | None = None,
    tolerance: float = 0.02,
) -> Candidate:
    """The candidate to run (see the module docstring)."""
    allowed = [
        c
        for c in candidates
        if c.layout.mode == "async"
        and (staleness_cap is None or c.layout.max_staleness <= staleness_cap)
    ]
    if not allowed:
        raise ValueError(
            "no async candidate within the staleness cap"
            + (f" {staleness_cap}" if staleness_cap is not None else "")
        )
    best = max(c.throughput for c in allowed)
    close = [c for c in allowed if c.throughput >= (1.0 - tolerance) * best]
    return min(
        close,
        key=lambda c: (c.layout.max_staleness, c.layout.prompts_per_batch, -c.throughput),
    )
