"""Which published versions become durable, and when durability may hold training up.

Pure bookkeeping, shared by the train role and the colocated sync loop so both run the
same durability policy (``checkpoint.*``; docs/design.md §2). Each published version
gets one of three answers:

- ``servable``: not due; the servers get it, storage does not.
- ``durable``: due and storage is free: snapshot it and write it in the background.
- ``skip``: due, but the durable write of an earlier version is still running; this
  version stays servable only and the next one tries again. Training never waits on
  storage for a version that is merely due ...
- ``wait``: ... unless it must be durable (the final version, a clean stop, a version
  the evaluation schedule names, or every version with ``every_versions: 1``), or the
  newest durable version has fallen ``max_lag_s`` behind the newest servable one.

The lag is measured from the first version published after the newest durable one:
how long the run has been serving weights a crash would lose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from sluice.infra.config.run import RunConfig
from sluice.tasks.run.eval_schedule import should_evaluate

log = logging.getLogger("sluice.train")

Decision = Literal["servable", "durable", "skip", "wait"]


def must_be_durable(config: RunConfig, version: int) -> bool:
    """The final version, and those the evaluation schedule scores (evaluation reads
    only durable versions), whatever the cadence."""
    return version >= config.trainer.total_steps or (
        config.evaluation.during_run and should_evaluate(version, config)
    )


def cadence_of(config: RunConfig, start_version: int, now: float) -> Cadence:
    """The cadence `checkpoint.*` asks for, from the durable version `start_version`."""
    cfg = config.checkpoint
    return Cadence(cfg.every_versions, cfg.every_s, cfg.max_lag_s, start_version, now)


@dataclass
class Cadence:
    """The durability cadence of one trainer incarnation (``checkpoint.*``)."""

    every_versions: int
    every_s: float | None
    max_lag_s: float
    last_durable_version: int
    """Step of the newest version made durable (or being made durable)."""
    last_durable_at: float
    """When that version was published (a monotonic clock's seconds)."""
    exposed_since: float | None = None
    """When the first version after it was published: None while there is none."""
    skipped: int = 0
    """Due versions that skipped durability so far."""
    warned: bool = field(default=False, repr=False)

    def lag_s(self, now: float) -> float:
        """Seconds the newest durable version trails the newest servable one."""
        return 0.0 if self.exposed_since is None else now - self.exposed_since

    def decide(self, version: int, now: float, *, must: bool, writing: bool) -> Decision:
        """What to do with `version`, published at `now`. `must`: it has to be durable;
        `writing`: an earlier version's durable write is still running."""
        due = (
            must
            or version - self.last_durable_version >= self.every_versions
            or (self.every_s is not None and now - self.last_durable_at >= self.every_s)
        )
        if not due:
            decision: Decision = "servable"
        elif not writing:
            decision = "durable"
        elif must or self.every_versions == 1 or self.lag_s(now) >= self.max_lag_s:
            decision = "wait"
        else:
            decision = "skip"
        self._warn(now)
        return decision

    def published(self, version: int, now: float, decision: Decision) -> None:
        """Record that `version` was published at `now` as `decide` said."""
        if decision in ("durable", "wait"):
            self.last_durable_version, self.last_durable_at = version, now
            self.exposed_since = None
            self.warned = False
            return
        if decision == "skip":
            self.skipped += 1
        if self.exposed_since is None:
            self.exposed_since = now

    def _warn(self, now: float) -> None:
        lag = self.lag_s(now)
        if not self.warned and lag >= self.max_lag_s / 2:
            self.warned = True
            log.warning(
                "the newest durable policy version (%d) is %.0f s behind the newest "
                "servable one: storage is slow or down; training waits for it at "
                "checkpoint.max_lag_s=%g s",
                self.last_durable_version,
                lag,
                self.max_lag_s,
            )
