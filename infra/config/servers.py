"""Which path a committed full-weight version's bytes take to the inference servers
(`servers.weight_transfer`; docs/design.md §2.1), with `auto` resolved by placement."""

from __future__ import annotations

from typing import Literal

from sluice.infra.config import RunConfig


def weight_transfer_path(config: RunConfig) -> Literal["disk", "distributed", "shared_memory"]:
    """The path full-weight versions take to the servers (`servers.weight_transfer`, with
    `auto` resolved by placement)."""
    chosen = config.servers.weight_transfer
    if (
        config.trainer.lora.rank
        or config.trainer.world_size > 1
        or config.trainer.backend != "torch"
    ):
        return "disk"  # adapters go as adapters; Megatron's weights need converting to HF
    if chosen != "auto":
        return chosen
    if not servers_on_gpu(config):
        if config.checkpoint.every_versions == 1 or config.servers.launch != "embedded":
            # Measured on a CPU (docs/reports/2026-11-27-weight-sync.md): the checkpoint
            # the trainer writes anyway is in the page cache, so a server reads it as
            # fast as it maps shared memory, and faster than gloo sends it.
            return "disk"
        # Versions that are not durable are not written at all: one copy into shared
        # memory beats writing and hashing a checkpoint only to serve it.
        return "disk" if config.rollout.server_urls else "shared_memory"
    if config.servers.launch == "embedded":
        return "disk" if config.rollout.server_urls else "shared_memory"
    return "distributed"


def servers_on_gpu(config: RunConfig) -> bool:
    """Whether the run's inference servers compute on GPUs (a weight group is NCCL then,
    gloo otherwise)."""
    if config.servers.launch != "embedded":
        return config.servers.gpus_per_server > 0
    if config.device == "auto":
        import torch

        return bool(torch.cuda.is_available())
    return config.device == "cuda"
