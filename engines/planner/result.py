"""What :func:`sluice.engines.planner.simulate.simulate` reports about one simulated run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimResult:
    """What one simulated run measured over its window (whole fleet unless noted)."""

    steps: int
    """Measured train steps (after warm-up)."""
    elapsed_s: float
    """Seconds from the end of the last warm-up step to the end of the last step."""
    seconds_per_step: float
    """Seconds: elapsed_s / steps."""
    trained_tokens_per_s: float
    """Tokens (prompt + response) trained per second in the window."""
    generated_tokens_per_s: float
    """Tokens decoded per second by all rollout servers in the window."""
    trainer_idle_ratio: float
    """Share of the window the trainer waited for data (sync: generation + reload)."""
    rollout_idle_ratio: float | None
    """Async: share of server time with no active sequence outside weight-update pauses
    (waiting on the gate, or nothing queued). Sync: None."""
    rollout_update_ratio: float | None
    """Async: share of server time spent in weight-update pauses. Sync: None."""
    staleness_mean: float
    """Versions: mean over the measured steps' groups of train step - dispatch version."""
    staleness_max: int
    """Versions: largest such staleness."""
    recomputed_tokens_per_update: float
    """Tokens: KV recomputed per server update (interruptible), mean over the window."""
    drain_wait_s_per_update: float
    """Seconds a server spent draining per update (drain mode), mean over the window."""
    train_s_per_step: float
    """Seconds: mean duration of a measured train step."""
    server_updates: int
    """Weight updates of the simulated servers whose pause started in the window."""
    servers: int
    """Inference servers of the layout."""
    simulated_servers: int
    """Servers actually simulated (min(servers, slice_servers))."""
    simulated_prompts_per_batch: int
    """Groups per batch actually simulated (B, or B_slice when sliced)."""
    batch_scale: float
    """(simulated_prompts_per_batch * servers / simulated_servers) / B: 1.0 unless the
    slice's batch had to be rounded."""
    trained_samples_total: int
    """Samples trained over the whole run, warm-up included (simulated slice)."""
    trained_groups_distinct: int
    """Distinct groups among those trained (equals trained_samples_total / G)."""
    dispatched_samples_total: int
    """Samples dispatched to servers over the whole run (simulated slice)."""
    finished_samples_total: int
    """Samples that produced their last token over the whole run (simulated slice)."""
    in_flight_samples_at_end: int
    """Samples queued or active on a server when the run ended (simulated slice)."""
