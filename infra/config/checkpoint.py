"""When a servable policy version becomes durable (docs/design.md §2: servable is not
durable).

A version is servable as soon as its weights can reach the servers; it is durable once
its weights, trainer state (the AdamW moments: twice the float32 weights) and consumed
list are on storage, hashed and committed. Durability runs on the trainer's background
thread at this cadence, and never stalls training unless it falls `max_lag_s` behind.
"""

from __future__ import annotations

from pydantic import Field

from sluice.infra.config.section import Section


class CheckpointConfig(Section):
    """Durability: how often a served version is also checkpointed to storage."""

    every_versions: int = Field(1, ge=1)
    """Make every N-th published version durable (its weights, trainer state and consumed list on
    storage, hashed, committed; the registry's `<alias>-durable` moves onto it). The versions
    between are servable only: the servers get them (over the sender, or as policy files on the disk
    path) without the trainer state. A crash costs at most N steps, retrained from the newest
    durable version, and (N + eta) x B groups, regenerated. 1 = every version durable, the trainer
    waiting for the one before (the behaviour before the split). The final version, every clean stop
    and every version the evaluation schedule names are durable whatever N is."""
    every_s: float | None = Field(None, gt=0)
    """Also make a version durable once this many seconds passed since the newest durable one
    (whichever of this and `every_versions` comes first): on S3 or a slow disk, a cadence in seconds
    bounds what a crash costs in wall time. None = by versions only."""
    max_lag_s: float = Field(600.0, gt=0)
    """A due version whose durability cannot start (the one before is still being written) skips it
    rather than stall training, until the newest servable version is this many seconds ahead of the
    newest durable one: then a warning, and training waits for storage. The run warns from half of
    it. Bounds the training a long storage outage can put at risk."""
