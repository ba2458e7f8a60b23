"""The following ranks (1..N-1) of a Megatron trainer split over several processes: child
processes the train role starts on its machine, or Ray actors (tasks/process/ray_ranks.py);
each builds its trainer with tasks/train/factory.py.

The role process is rank 0 (``sluice.engines.megatron.lockstep.LockstepTrainer`` leads). Ranks
1..N-1 are fresh interpreters (spawned: the role process has threads and torch state
that a fork would copy) that build the same trainer from the same config and
checkpoint directory, then follow rank 0's calls. Each rank dies with the role
(``PR_SET_PDEATHSIG``), so a killed role never leaves ranks waiting on a broadcast.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from sluice.infra.config.run import RunConfig
from sluice.tasks.process.ports import free_port
from sluice.tasks.process.ray_ranks import TRAIN_GROUP_ENV, RankStart, RayRanks
from sluice.tasks.train.factory import build_rank_trainer

PR_SET_PDEATHSIG = 1


def start_following_ranks(
    config: RunConfig, model_dir: Path, start: RankStart | None = None
) -> list[BaseProcess] | RayRanks:
    """Start ranks 1..N-1 and make this process rank 0 of a group of N (``trainer.world_size``):
    child processes here, or, for a train role Ray placed, actors in the placement
    group the flow reserved for them (tasks/process/ray_ranks.py), which fetch `start`
    (the version `model_dir` holds) from storage on a node of their own."""
    if os.environ.get(TRAIN_GROUP_ENV):
        from sluice.tasks.process.ray_ranks import start_ray_ranks

        return start_ray_ranks(config, model_dir, torch.get_num_threads(), start)
    world = config.trainer.world_size
    port = free_port()
    # This process is the role and the group's rank 0; its children read the same.
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    )
    os.environ["RANK"] = "0"
    context = multiprocessing.get_context("spawn")
    ranks = []
    for rank in range(1, world):
        process = context.Process(
            target=follow_main,
            args=(config.model_dump_json(), str(model_dir), rank, torch.get_num_threads()),
            name=f"sluice-train-rank{rank}",
            daemon=True,
        )
        process.start()
        ranks.append(process)
    return ranks


def follow_main(config_json: str, model_dir: str, rank: int, threads: int) -> None:
    """A following rank: build the trainer, repeat rank 0's calls, exit when it closes."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the daemon flag applies
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ["RANK"] = str(rank)
    from sluice.engines.megatron.lockstep import follow

    torch.set_num_threads(threads)
    config = RunConfig.model_validate_json(config_json)
    follow(build_rank_trainer(config, Path(model_dir)))


def join(ranks: list[BaseProcess] | RayRanks, timeout_s: float = 60.0) -> None:
    """Wait for released ranks to exit (killed if they do not)."""
    if isinstance(ranks, RayRanks):
        ranks.join(timeout_s)
        return
    for process in ranks:
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
