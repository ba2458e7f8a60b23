"""Driving a trainer split over processes from one place: rank 0 leads, the others follow.

However the trainer is split (tensor, pipeline or data parallel), every rank must make
the same calls with the same samples: each holds part of the model or part of the
micro-batches, and every call is collective. Sluice's train role is rank 0: it reads the
streams, builds each batch and publishes versions. ``LockstepTrainer`` wraps its
trainer so that every collective call is first broadcast to the other ranks, which
run ``follow`` and repeat it; the role's code does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from sluice.engines.rl.train_batch import TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer


class LockstepTrainer:
    """Rank 0's trainer: ``train_step`` and ``save`` run on every rank; the rest is local."""

    def __init__(self, trainer: PolicyTrainer, on_close: Callable[[], None] | None = None) -> None:
        """``on_close`` runs after the other ranks are released (e.g. to join them)."""
        self.trainer = trainer
        self._on_close = on_close

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)

    def train_step(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        _broadcast(("train_step", (list(samples),), {}))
        return self.trainer.train_step(samples)

    def save(self, out_dir: str | Path, **kwargs: Any) -> Path:
        _broadcast(("save", (str(out_dir),), kwargs))
        return self.trainer.save(out_dir, **kwargs)

    def close(self) -> None:
        """Release the following ranks (they return from ``follow``)."""
        _broadcast(("close", (), {}))
        if self._on_close is not None:
            self._on_close()


def follow(trainer: PolicyTrainer) -> None:
    """Ranks other than 0: repeat every call rank 0's ``LockstepTrainer`` makes, until it closes."""
    while True:
        box: list[Any] = [None]
        torch.distributed.broadcast_object_list(box, src=0)
        name, args, kwargs = box[0]
        if name == "close":
            return
        getattr(trainer, name)(*args, **kwargs)


def _broadcast(command: tuple[str, tuple[Any, ...], dict[str, Any]]) -> None:
    torch.distributed.broadcast_object_list([command], src=0)
