"""The rollout role's running counts, which its status document reports."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

from sluice.engines.inference.profile import StepProfile
from sluice.engines.rl.samples import version_span
from sluice.engines.trajectory import (
    LOSS_MASK,
    RESPONSE_TOKEN_IDS,
    TOKEN_VERSIONS,
    TOOL_CALLS,
    TOOL_ERRORS,
    TOOL_TIMEOUTS,
    TURNS,
)
from sluice.infra.serving.client import InferenceClient, InferenceServerError
from sluice.tasks.run.state_timer import StateTimer

log = logging.getLogger("sluice.rollout")

ROLLOUT_STATES = ("start", "generate", "poll", "reload", "idle", "write")
"""Where the rollout role's loop spends its time (tasks/run/state_timer.py): its setup
(first version, weights, servers), waiting on in-flight groups, asking the registry for
a newer version (and the scored stream for refills), fetching and loading a newer
version, nothing in flight and the staleness gate closed, writing finished groups."""


@dataclass
class RolloutStats:
    started_at: float = field(default_factory=time.monotonic)
    groups_written: int = 0
    samples_written: int = 0
    tokens_generated: int = 0
    weight_updates: int = 0
    update_time_s: float = 0.0
    commit_to_served_s: list[float] = field(default_factory=list)
    """Per weight update: seconds from the version's commit (its registry time) to every
    server holding it (the poll's wait, the fetch and the load)."""
    weight_path: str = "disk"
    """How full-weight versions reach the servers (`servers.weight_transfer`, resolved)."""
    weight_bytes_moved: int = 0
    """Bytes of weights sent to each server over a fast path (0 on disk)."""
    weight_fallbacks: int = 0
    """Versions a fast path failed to deliver, loaded from disk instead."""
    partial_samples: int = 0
    groups_refilled: int = 0
    """Dynamic sampling: slots given back for groups scored with all rewards equal."""
    groups_lineage_dropped: int = 0
    """Groups that held tokens of versions a trainer restart lost (issued again): those
    written to the stream, as of the newest scan, plus those dropped as they finished."""
    max_version_span: int = 0
    server_recoveries: int = 0
    episode_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    observation_tokens: int = 0
    engine_profile: dict[str, Any] | None = None
    """The servers' measured step costs, summed (sluice.engines.inference.profile)."""
    server_peak_rss_mb: float | None = None
    """The largest peak resident memory an inference server reported, MiB (None: none did)."""
    timer: StateTimer = field(default_factory=lambda: StateTimer(ROLLOUT_STATES, initial="start"))
    """The role loop's time split into states; reported as `time/<state>_s` and `_frac`."""

    def record_group(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Count one group written to the stream (`rows`: its samples, `TrajectoryRow`s
        or their columns)."""
        self.groups_written += 1
        self.samples_written += len(rows)
        for r in rows:
            mask = r.get(LOSS_MASK)
            observed = len(mask) - sum(mask) if mask is not None else 0
            self.tokens_generated += len(r[RESPONSE_TOKEN_IDS]) - observed
            self.observation_tokens += observed
            self.episode_turns += r.get(TURNS, 0)
            self.tool_calls += r.get(TOOL_CALLS, 0)
            self.tool_errors += r.get(TOOL_ERRORS, 0)
            self.tool_timeouts += r.get(TOOL_TIMEOUTS, 0)
            span = version_span(r[TOKEN_VERSIONS])
            if span:  # a weight update landed while this response was being generated
                self.partial_samples += 1
                self.max_version_span = max(self.max_version_span, span)

    def as_status(self) -> dict[str, Any]:
        elapsed = max(1e-9, time.monotonic() - self.started_at)
        return {
            "groups_written": self.groups_written,
            "samples_written": self.samples_written,
            "tokens_generated": self.tokens_generated,
            "tokens_per_s": self.tokens_generated / elapsed,
            # The timer's `idle` share: an idle span still open counts too.
            "idle_ratio": self.timer.share("idle"),
            "weight_updates": self.weight_updates,
            "update_time_s": self.update_time_s,
            "commit_to_served_s_median": (
                float(statistics.median(self.commit_to_served_s))
                if self.commit_to_served_s
                else None
            ),
            "weight_path": self.weight_path,
            "weight_bytes_moved": self.weight_bytes_moved,
            "weight_fallbacks": self.weight_fallbacks,
            "partial_rollout_ratio": self.partial_samples / max(1, self.samples_written),
            "groups_refilled": self.groups_refilled,
            "groups_lineage_dropped": self.groups_lineage_dropped,
            "max_version_span": self.max_version_span,
            "server_recoveries": self.server_recoveries,
            **(self.episode_status() if self.episode_turns else {}),
            **({"engine_profile": self.engine_profile} if self.engine_profile else {}),
            "server_peak_rss_mb": self.server_peak_rss_mb,
            **self.timer.report(),
        }

    def episode_status(self) -> dict[str, Any]:
        return {
            "turns_per_episode": self.episode_turns / max(1, self.samples_written),
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "tool_timeouts": self.tool_timeouts,
            "observation_tokens": self.observation_tokens,
        }

    async def read_servers(self, client: InferenceClient, timeout_s: float) -> None:
        """Keep the servers' measured step costs and peak memory for the run's status
        (best effort: a server that does not answer now is read next time)."""
        try:
            states = await asyncio.wait_for(client.server_states(), timeout_s)
        except (InferenceServerError, ValueError, TimeoutError) as exc:
            log.debug("server states not read: %s", exc or type(exc).__name__)
            return
        profiles = [
            StepProfile.from_dict(s["step_profile"])
            for s in states.values()
            if isinstance(s.get("step_profile"), dict)
        ]
        if profiles:
            self.engine_profile = reduce(StepProfile.merged, profiles).as_dict()
        peaks = [
            s["peak_rss_mb"]
            for s in states.values()
            if isinstance(s.get("peak_rss_mb"), float | int)
        ]
        if peaks:
            self.server_peak_rss_mb = max([self.server_peak_rss_mb or 0.0, *peaks])
