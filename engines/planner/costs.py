"""What the pipeline simulator (:mod:`sluice.engines.planner.simulate`) takes: costs, workload, layout.

Three frozen dataclasses, built by hand in tests and from a run's measurements by the
calibration (``sluice.engines.planner.calibrate``):

- :class:`CostModel`: seconds per unit of work on one device (decode, prefill, train,
  weight update, publish, reward) and how they scale with devices;
- :class:`Workload`: the empirical prompt and response lengths a run samples from;
- :class:`Layout`: sync or async, how the devices are split, batch size, staleness
  bound, how weight updates reach the inference servers.

Each validates itself on construction and raises one ``ValueError`` naming the field.
Length samples may be given as any sequence of integers (a list, a numpy array); they
are stored as tuples of ``int`` so the dataclasses stay hashable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

MODES = ("sync", "async")
"""Values of :attr:`Layout.mode`."""

BATCH_ORDERS = ("issue", "finish")
"""Values of :attr:`Layout.batch_order`."""


def _int_tuple(name: str, values: Sequence[int], minimum: int) -> tuple[int, ...]:
    out = tuple(int(v) for v in values)
    if not out:
        raise ValueError(f"{name} is empty; it needs at least one length")
    low = min(out)
    if low < minimum:
        raise ValueError(f"{name} must hold lengths >= {minimum}, got {low}")
    return out


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work for ONE device; the simulator scales them to servers."""

    decode_step_s: float
    """Seconds: fixed cost of one decode step of one server (weights read, launch and
    Python overhead), whatever the number of active sequences."""
    decode_row_s: float
    """Seconds per active sequence per decode step."""
    decode_context_s: float
    """Seconds per context token (prompt + generated so far) of every active sequence per
    decode step (reading the KV cache)."""
    prefill_token_s: float
    """Seconds per prefilled token: new prompts, and the KV recompute of every active
    sequence after an interruptible weight update."""
    weight_load_s: float
    """Seconds a server pauses to load new weights."""
    train_token_s: float
    """Seconds per trained token (prompt + response) on ONE train device, all passes
    included (proximal forward, forward, backward)."""
    prefill_call_s: float = 0.0
    """Seconds of fixed cost per prefill pass (a step that admits prompts, or the
    recompute after an interruptible update), on top of ``prefill_token_s`` per token."""
    train_step_s: float = 0.0
    """Seconds of fixed cost per optimizer step (one device)."""
    train_micro_batch_s: float = 0.0
    """Seconds of fixed cost per micro-batch (one device)."""
    publish_s: float = 0.0
    """Seconds from the end of a train step to the new weights being visible to the
    rollout servers (save, upload, commit, poll)."""
    reward_s: float = 0.0
    """Seconds from a sample's last token to its reward (a service, not a device)."""
    train_scaling: float = 1.0
    """Exponent: train time on T devices = single-device time / T**train_scaling
    (1 = linear speed-up, 0 = none)."""
    decode_scaling: float = 1.0
    """Exponent: a server spanning k devices runs every decode and prefill cost faster by
    k**decode_scaling (1 = linear speed-up, 0 = none)."""
    sync_step_overhead_s: float | None = None
    """Seconds a sync step spends outside generation and training (scoring, publish,
    reload, offload, bookkeeping) as measured on a colocated run; when set it replaces
    ``reward_s + publish_s + weight_load_s`` in a sync step. None = use those three.
    Ignored in async."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{f.name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True)
class Workload:
    """Lengths a run samples from: one prompt per group of G responses."""

    response_lengths: tuple[int, ...]
    """Tokens: empirical response-length sample; responses are drawn from it with
    replacement. Each length >= 1."""
    prompt_lengths: tuple[int, ...]
    """Tokens: empirical prompt-length sample; a group's G samples share one prompt drawn
    from it. Each length >= 0."""
    group_size: int
    """G: samples per prompt group (>= 1)."""
    max_new_tokens: int | None = None
    """Tokens: cap applied to every response length (drawn or fixed); None = no cap."""
    prefill_shared_by_group: bool = True
    """True: a group's prompt is prefilled once per server (prompt cache); False: once per
    sample, G times."""
    trained_fraction: float = 1.0
    """Share of a batch's tokens the trainer trains, in (0, 1]: Sluice drops groups whose
    rewards are all equal before the forward passes (no advantage), so a run trains
    fewer tokens than it samples. Trainer time and trained tokens scale by it."""
    fixed_response_lengths: tuple[int, ...] | None = None
    """Tokens: exact response lengths instead of draws, cycled in sample order (sample j
    of group n is sample n*G + j and gets ``fixed_response_lengths[(n*G + j) % len]``).
    For hand-worked cases; None = draw from ``response_lengths``."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "response_lengths", _int_tuple("response_lengths", self.response_lengths, 1)
        )
        object.__setattr__(
            self, "prompt_lengths", _int_tuple("prompt_lengths", self.prompt_lengths, 0)
        )
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0.0 < self.trained_fraction <= 1.0:
            raise ValueError(f"trained_fraction must be in (0, 1], got {self.trained_fraction}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or None, got {self.max_new_tokens}")
        if self.fixed_response_lengths is not None:
            object.__setattr__(
                self,
                "fixed_response_lengths",
                _int_tuple("fixed_response_lengths", self.fixed_response_lengths, 1),
            )


@dataclass(frozen=True)
class Layout:
    """How the devices are used: colocated (sync) or split between rollout and training."""

    mode: str
    """Either "sync" (all devices generate, then all train, then the servers reload) or
    "async" (rollout servers generate continuously while the trainer trains)."""
    devices: int
    """D: total devices."""
    rollout_devices: int
    """R (async): devices serving generation; the trainer gets T = D - R. Ignored for sync."""
    prompts_per_batch: int
    """B: prompt groups per train step."""
    max_staleness: int = 0
    """eta (async): group n may start only while floor(n / B) <= v + eta, v the newest
    version visible to the rollout. Must be >= publish_every - 1. Ignored for sync."""
    interruptible: bool = True
    """Async weight updates: True = interrupt in-flight sequences (pause, recompute their
    KV, continue); False = drain (stop admitting, finish in-flight on the old weights,
    then load)."""
    publish_every: int = 1
    """Train steps per published version (async): version k becomes visible only if
    k % publish_every == 0. Ignored for sync."""
    devices_per_server: int = 1
    """Devices one inference server spans (tensor parallel); servers = rollout devices //
    devices_per_server (sync: devices // devices_per_server)."""
    slots_per_server: int = 256
    """Most sequences one server decodes at once (continuous batching)."""
    max_tokens_per_micro_batch: int = 32768
    """Tokens: budget of one training micro-batch (sluice.engines.rl.batching.dynamic_micro_batches)."""
    batch_order: str = "issue"
    """Async batch membership: "issue" = train batch k is groups kB .. kB+B-1 (Sluice);
    "finish" = the next B groups to finish (AReaL)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.batch_order not in BATCH_ORDERS:
            raise ValueError(f"batch_order must be one of {BATCH_ORDERS}, got {self.batch_order!r}")
        for name in (
            "devices",
            "prompts_per_batch",
            "publish_every",
            "devices_per_server",
            "slots_per_server",
            "max_tokens_per_micro_batch",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.mode == "sync":
            if self.devices < self.devices_per_server:
                raise ValueError(
                    f"devices ({self.devices}) must be >= devices_per_server "
                    f"({self.devices_per_server}) for one inference server"
                )
            return
        if not 1 <= self.rollout_devices <= self.devices - 1:
            raise ValueError(
                f"rollout_devices must be in 1 .. devices - 1 = {self.devices - 1} for async "
                f"(at least one train device), got {self.rollout_devices}"
            )
        if self.rollout_devices < self.devices_per_server:
            raise ValueError(
                f"rollout_devices ({self.rollout_devices}) must be >= devices_per_server "
                f"({self.devices_per_server}) for one inference server"
            )
        if self.max_staleness < self.publish_every - 1:
            raise ValueError(
                f"max_staleness ({self.max_staleness}) must be >= publish_every - 1 "
                f"({self.publish_every - 1}): otherwise the gate waits for a version that "
                "is never published"
            )

    @property
    def servers(self) -> int:
        """Inference servers: the rollout devices (sync: all) // devices_per_server."""
        rollout = self.devices if self.mode == "sync" else self.rollout_devices
        return rollout // self.devices_per_server

    @property
    def train_devices(self) -> int:
        """Devices that train: all of them in sync, D - R in async."""
        return self.devices if self.mode == "sync" else self.devices - self.rollout_devices
