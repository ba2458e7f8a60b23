"""What megatron-core 0.16 needs to run on a CPU: two patches, installed only without CUDA.

Megatron is written for GPUs and reaches for CUDA in a few places even when every
tensor is on the CPU. Sluice trains its small default policies on CPUs (and tests the
Megatron backend there, under gloo), so ``install()`` patches exactly these, each
for the reason given. With a GPU present it does nothing.
"""

from __future__ import annotations

import torch

_installed = False


def install() -> bool:
    """Patch Megatron for a CUDA-less process (idempotent); returns whether it patched."""
    global _installed
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    # 1. Rotary embeddings, tensor-parallel gathers and attention buffers allocate on
    #    ``torch.cuda.current_device()`` (an int on a GPU). On a CPU-only build that call
    #    raises; answering "cpu" puts those allocations beside the model's tensors.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]

    # 2. Dropout runs inside ``get_cuda_rng_tracker().fork()``, and the training tracker
    #    snapshots and restores CUDA generator states. Sluice trains with dropout 0, so
    #    the no-op tracker Megatron ships for inference is exact here.
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _installed = True
    return True
