"""A split trainer's ranks on a Ray cluster (`cluster.engine: ray`, `trainer.world_size` > 1).

The flow reserves a placement group of `world_size` bundles, each what `cluster.train`
asks, spread as `cluster.train_strategy` says, and places the train role in bundle 0.
The train role's process is rank 0, as on one machine: it joins the cluster as a Ray
driver and starts ranks 1..N-1 as actors in bundles 1..N-1, which may be on other
nodes. They meet rank 0 at its node's address (torch.distributed's env:// rendezvous,
gloo on CPU) and then follow its calls (`sluice.engines.megatron.lockstep`).

Each rank builds its trainer from the trainer's start directory at the same path as
rank 0's: on one machine, or with `cluster.node_workdir` on a file system every node
mounts. A rank that cannot read it stops the role in one line. The ranks are actors
owned by rank 0's process, so a lost train node takes them with it (and a lost rank's
node stops rank 0's next collective call).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from sluice.infra.config import RunConfig
from sluice.tasks.process.ports import free_port

RAY_ADDRESS_ENV = "SLUICE_RAY_ADDRESS"
"""The cluster's GCS address, set for a train role placed by Ray."""
TRAIN_GROUP_ENV = "SLUICE_TRAIN_PLACEMENT_GROUP"
"""The name of the placement group reserved for the trainer's ranks."""
NAMESPACE = "sluice"
JOIN_TIMEOUT_S = 60.0


class RankActor:
    """One following rank, in a Ray worker on whatever node its bundle is on."""

    def node_reading(self, model_dir: str, rank: int) -> str:
        """This rank's node, once it is sure to read the trainer's start directory
        (checked before any rank waits on the others' rendezvous)."""
        import ray

        if not Path(model_dir).is_dir():
            raise RuntimeError(
                f"trainer rank {rank} on {socket.gethostname()} cannot read the trainer's "
                f"start directory {model_dir} (rank 0's node): ranks on other machines "
                "need cluster.node_workdir on a file system every node mounts"
            )
        return str(ray.get_runtime_context().get_node_id())

    def follow(
        self, config_json: str, model_dir: str, rank: int, master: str, port: int, threads: int
    ) -> None:
        import torch

        from sluice.engines.megatron.lockstep import follow
        from sluice.tasks.process.trainer_factory import build_rank_trainer

        config = RunConfig.model_validate_json(config_json)
        os.environ.update(
            {
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(config.trainer.world_size),
                "RANK": str(rank),
            }
        )
        torch.set_num_threads(threads)
        follow(build_rank_trainer(config, Path(model_dir)))


class RayRanks:
    """Ranks 1..N-1 as actors; `join` waits for them to return after rank 0 closes."""

    def __init__(self, actors: list[Any], done: list[Any]) -> None:
        self.actors = actors
        self.done = done

    def join(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        import ray

        try:
            ray.get(self.done, timeout=timeout_s)
        finally:
            for actor in self.actors:
                ray.kill(actor)


def node_address() -> str:
    """The address this process's Ray node registered (`ray start --node-ip-address`):
    the one the other nodes reach it by. `ray.util.get_node_ip_address()` in a worker
    guesses from the machine's outward route instead, another address on a machine
    with several."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here and node.get("NodeManagerAddress"):
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


def start_ray_ranks(config: RunConfig, model_dir: Path, threads: int) -> RayRanks:
    """Start ranks 1..N-1 in the trainer's placement group; this process becomes rank 0."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=os.environ[RAY_ADDRESS_ENV], namespace=NAMESPACE, log_to_driver=False)
    group = ray.util.get_placement_group(os.environ[TRAIN_GROUP_ENV])
    master, port = node_address(), free_port("")
    world = config.trainer.world_size
    os.environ.update(
        {"MASTER_ADDR": master, "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": "0"}
    )
    placement = config.cluster.placement("train")
    actor_class = ray.remote(RankActor)
    actors = [
        actor_class.options(
            **placement.ray_options(),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank
            ),
        ).remote()
        for rank in range(1, world)
    ]
    here = ray.get_runtime_context().get_node_id()
    try:
        nodes = ray.get(
            [actor.node_reading.remote(str(model_dir), r) for r, actor in enumerate(actors, 1)],
            timeout=JOIN_TIMEOUT_S,
        )
    except Exception:
        for actor in actors:
            ray.kill(actor)
        raise
    model_parallel = config.trainer.tensor_parallel * config.trainer.pipeline_parallel
    if model_parallel > 1 and not config.cluster.shared_filesystem and set(nodes) - {here}:
        for actor in actors:
            ray.kill(actor)
        raise RuntimeError(
            "tensor or pipeline parallel ranks on other nodes write their optimizer shards "
            "into rank 0's checkpoint directory: set cluster.node_workdir on a shared file "
            "system and cluster.shared_filesystem=true, or cluster.train_strategy="
            "STRICT_PACK to keep the ranks on one node"
        )
    config_json = config.model_dump_json()
    done = [
        actor.follow.remote(config_json, str(model_dir), rank, master, port, threads)
        for rank, actor in enumerate(actors, start=1)
    ]
    return RayRanks(actors, done)
