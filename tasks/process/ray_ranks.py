"""A split trainer's ranks on a Ray cluster (`cluster.engine: ray`, `trainer.world_size` > 1).

The flow reserves a placement group of `world_size` bundles, each what `cluster.train`
asks, spread as `cluster.train_strategy` says, and places the train role in bundle 0.
The train role's process is rank 0, as on one machine: it joins the cluster as a Ray
driver and starts ranks 1..N-1 as actors in bundles 1..N-1, which may be on other
nodes. They meet rank 0 at its node's registered address (torch.distributed's env://
rendezvous, gloo on CPU; `GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME` name the
interface that holds each rank's node address, unless set already) and then follow
its calls (`sluice.engines.megatron.lockstep`).

Each rank builds its trainer from the version the train role starts from. A rank on
rank 0's node reads rank 0's start directory; a rank on another node fetches that
version (policy and trainer state) from the run's storage into its own node's
`cluster.node_workdir` (unless `cluster.shared_filesystem` says rank 0's path is
readable everywhere), and a tensor or pipeline parallel one writes its optimizer shard
there too, to be sent to rank 0 at each save (`MegatronPolicyTrainer.shard_home`). The
ranks are actors owned by rank 0's process, so a lost train
node takes them with it (and a lost rank's node stops rank 0's next collective call).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from sluice.infra.config.run import RunConfig
from sluice.infra.registry import CommittedVersion
from sluice.tasks.process.ports import free_port

RAY_ADDRESS_ENV = "SLUICE_RAY_ADDRESS"
"""The cluster's GCS address, set for a train role placed by Ray."""
TRAIN_GROUP_ENV = "SLUICE_TRAIN_PLACEMENT_GROUP"
"""The name of the placement group reserved for the trainer's ranks."""
NAMESPACE = "sluice"
JOIN_TIMEOUT_S = 60.0


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` on this machine (None: none does)."""
    import psutil

    for name, entries in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in entries):
            return name
    return None


def name_interface(address: str) -> None:
    """Point gloo and NCCL at the interface of this node's registered `address`, unless
    the user named one: on a machine with several, their own guess may be another."""
    name = interface_of(address)
    if name is not None:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, name)


class RankActor:
    """One following rank, in a Ray worker on whatever node its bundle is on."""

    def prepare(
        self, config_json: str, model_dir: str, rank: int, start: str | None
    ) -> list[str | None]:
        """This rank's node, the start directory it builds from once it has one (before
        any rank waits on the others' rendezvous) and where it writes its optimizer
        shard (None: into rank 0's directory): rank 0's on rank 0's node or a shared
        file system, else `start` (a `RankStart`) fetched from storage."""
        import ray

        config = RunConfig.model_validate_json(config_json)
        here = str(ray.get_runtime_context().get_node_id())
        readable = Path(model_dir).is_dir()
        if start is not None and not (readable and self.beside_rank0(start, here, config)):
            away = RankStart.model_validate_json(start)
            return [here, str(away.fetch(config, rank)), str(away.local(config, rank) / "shards")]
        if not readable:
            raise RuntimeError(
                f"trainer rank {rank} on {socket.gethostname()} cannot read the trainer's "
                f"start directory {model_dir} (rank 0's node) and was given no version "
                "to fetch from storage"
            )
        return [here, model_dir, None]

    @staticmethod
    def beside_rank0(start: str, here: str, config: RunConfig) -> bool:
        """Whether rank 0's start directory is this node's file too."""
        return config.cluster.shared_filesystem or RankStart.model_validate_json(start).node == here

    def follow(
        self,
        config_json: str,
        model_dir: str,
        rank: int,
        master: str,
        port: int,
        threads: int,
        shard_home: str | None = None,
    ) -> None:
        import torch

        from sluice.engines.megatron.lockstep import follow
        from sluice.tasks.train.factory import build_rank_trainer

        config = RunConfig.model_validate_json(config_json)
        name_interface(node_address())
        os.environ.update(
            {
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(config.trainer.world_size),
                "RANK": str(rank),
            }
        )
        torch.set_num_threads(threads)
        trainer = build_rank_trainer(config, Path(model_dir))
        if shard_home is not None:  # rank 0's checkpoint directory is not on this node
            trainer.shard_home = Path(shard_home)  # type: ignore[attr-defined]
        follow(trainer)


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


class RankStart(BaseModel):
    """The version a split trainer starts from, as a rank on another node fetches it."""

    run_id: str
    version: CommittedVersion
    node: str = ""
    """Rank 0's Ray node (its start directory is a file there)."""

    def local(self, config: RunConfig, rank: int) -> Path:
        """Rank `rank`'s folder in this node's workdir."""
        return Path(config.workdir) / "runs" / self.run_id / f"train-rank{rank}"

    def fetch(self, config: RunConfig, rank: int) -> Path:
        """The version's policy and trainer state, in this node's workdir."""
        from sluice.tasks.run.paths import run_paths
        from sluice.tasks.run.versions import fetch_training_dir

        local = self.local(config, rank) / "start"
        return fetch_training_dir(config, run_paths(config, self.run_id), self.version, local)


def start_ray_ranks(
    config: RunConfig, model_dir: Path, threads: int, start: RankStart | None = None
) -> RayRanks:
    """Start ranks 1..N-1 in the trainer's placement group; this process becomes rank 0.
    `start`: the version `model_dir` holds, for ranks on other nodes to fetch."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=os.environ[RAY_ADDRESS_ENV], namespace=NAMESPACE, log_to_driver=False)
    group = ray.util.get_placement_group(os.environ[TRAIN_GROUP_ENV])
    master, port = node_address(), free_port("")
    name_interface(master)
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
    config_json = config.model_dump_json()
    shipped = start.model_copy(update={"node": here}).model_dump_json() if start else None
    try:
        prepared = ray.get(
            [
                actor.prepare.remote(config_json, str(model_dir), r, shipped)
                for r, actor in enumerate(actors, 1)
            ],
            timeout=config.cluster.placement_timeout_s + JOIN_TIMEOUT_S,  # a fetch included
        )
    except Exception:
        for actor in actors:
            ray.kill(actor)
        raise
    # A rank that fetched its start (another node) writes its optimizer shard at home,
    # and it travels to rank 0 (tensor or pipeline parallel: MegatronPolicyTrainer).
    done = [
        actor.follow.remote(config_json, where, rank, master, port, threads, home)
        for rank, (actor, (_, where, home)) in enumerate(zip(actors, prepared, strict=True), 1)
    ]
    return RayRanks(actors, done)
