"""What megatron-core 0.16 needs to run on a CPU, applied only where CUDA is absent.

Megatron is written for GPUs and reaches for CUDA in a few places even when every
tensor is on the CPU. Sluice trains its small default policies on CPUs (and tests the
Megatron backend there, under gloo). ``install()`` sets up Megatron's RNG tracker
once; ``cpu_only()`` patches the CUDA reaches for the duration of a block of Megatron
calls and restores them after, so nothing else in the process sees a changed torch.
With a GPU present both do nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")
_installed = False


def install() -> None:
    """One-time setup for a CUDA-less process (idempotent)."""
    global _installed
    if torch.cuda.is_available() or _installed:
        return
    # Dropout runs inside ``get_cuda_rng_tracker().fork()``, and the training tracker
    # snapshots and restores CUDA generator states. Sluice trains with dropout 0, so
    # the no-op tracker Megatron ships for inference is exact here.
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _installed = True


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


_tensor_type = torch.Tensor.type


def _type_as_on_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    name = _tensor_type(self, *args, **kwargs)
    if args or kwargs or self.device.type != "cpu":
        return name
    return name.replace("torch.", "torch.cuda.", 1)


@contextlib.contextmanager
def cpu_only() -> Iterator[None]:
    """Within the block, Megatron's CUDA-only calls act on the CPU."""
    if torch.cuda.is_available():
        yield
        return
    install()
    saved: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", torch.cuda.current_device),
        (torch.cuda, "synchronize", torch.cuda.synchronize),
        (torch.Tensor, "cuda", torch.Tensor.cuda),
        (torch.Tensor, "type", torch.Tensor.type),
        *[(torch, name, getattr(torch, name)) for name in _FACTORIES],
    ]
    # 1. Rotary tables, tensor-parallel gathers and attention buffers allocate on
    #    ``torch.cuda.current_device()`` (an int on a GPU, an error without one).
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]
    # 2. Pipeline stages synchronise the device after each send/receive; CPU work is
    #    already finished when the call returns.
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    # 3. The optimizers and grad-norm helpers create their scalars with device="cuda"
    #    or ``.cuda()``; without CUDA those can only mean the CPU.
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    # 4. The mixed-precision optimizer and gradient clipping tell bf16/fp16 parameters
    #    from fp32 ones by type name, accepting only CUDA names: a CPU tensor reports the
    #    CUDA name of its dtype (``type(dtype)`` conversions are untouched).
    torch.Tensor.type = _type_as_on_cuda  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
