"""Where a run's processes go: on this machine (the default) or on a Ray cluster.

With `cluster.engine: ray` each role's Prefect task runs on a Ray node that has the
resources its placement asks for (prefect-ray's task runner), and the role's process
starts there. What crosses between nodes is what already crossed between processes:
object-storage streams, the MLflow registry, HTTP to inference servers. So a cluster
needs those three to be reachable from every node; `cluster_requirements` says what
is missing in one line each, before anything starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from sluice.infra.config.section import Section

LOCAL_TRACKING_SCHEMES = ("sqlite", "file", "")
"""MLflow tracking URIs that live on the flow's machine only."""
SHARED_STORAGE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hdfs")
"""fsspec schemes every node reaches by itself."""


class RolePlacement(Section):
    """What one role (or one inference server) asks of the Ray node it runs on."""

    num_cpus: float = Field(1.0, ge=0)
    """Logical CPUs Ray reserves on the node (scheduling only: the role's torch threads are `threads_per_role`)."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs Ray reserves and makes visible (`CUDA_VISIBLE_DEVICES`) to the role; 0 for CPU roles."""
    resources: dict[str, float] = {}
    """Custom Ray resources the node must offer, e.g. `{node_type_rollout: 1}` for a node started with `ray start --resources '{"node_type_rollout": 1}'`. Empty = any node with the CPUs and GPUs."""

    @field_validator("resources")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {name: amount for name, amount in value.items() if amount <= 0}
        if bad:
            raise ValueError(f"resource amounts must be > 0: {bad}")
        return value

    def ray_options(self) -> dict[str, object]:
        """The `ray.remote` options of this placement (the fields are named as Ray's)."""
        options: dict[str, object] = self.model_dump()
        if not self.resources:
            del options["resources"]
        return options


class ClusterConfig(Section):
    """Placement of the run's roles: this machine, or a Ray cluster."""

    engine: Literal["local", "ray"] = "local"
    """`local`: every role is a process on the flow's machine. `ray`: each role's Prefect task runs on a Ray node chosen by its placement below (prefect-ray), and the role's process starts there."""
    address: str | None = None
    """Ray cluster to join: `auto` (a cluster this machine is a node of), `HOST:6379` (its head's
    GCS), or `ray://HOST:10001` (Ray client). None = a one-node Ray instance started on this machine
    for the run (for trying the mode out; nothing spans machines)."""
    shared_filesystem: bool = False
    """Declare that a `file://` `storage.url`, and `node_workdir`, are the same shared file system
    (NFS, Lustre, ...) at the same path on every node. Without it a cluster needs object storage
    (`s3://`), its only shared medium. With it, a split trainer's ranks on other nodes read rank 0's
    start directory and write their optimizer shards into its checkpoint directory instead of
    fetching from storage and sending their shards to rank 0 (an optimisation, never a requirement)."""
    node_workdir: str | None = None
    """Local directory on each node for the roles' caches (fetched weights) and logs. None = `workdir` resolved to an absolute path on the flow's machine, which every node must be able to create."""
    train_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How a split trainer's ranks (`trainer.world_size` > 1, one `cluster.train` bundle each)
    spread over nodes: Ray's placement-group strategy. `STRICT_SPREAD` puts every rank on a node of
    its own, `STRICT_PACK` all on one. A rank on another node than rank 0 fetches the start version
    from storage, and a tensor or pipeline parallel one sends its optimizer shard to rank 0 at each
    save (over gloo: that costs the shard's size in rank 0's memory and network)."""
    placement_timeout_s: float = Field(600.0, gt=0)
    """How long a role's task may wait for a node that offers its placement (at the start, or after
    its node was lost) before the run stops with one line. A placement no node of the cluster offers
    at all is refused at once."""
    env: dict[str, str] = {}
    """Environment variables for the role processes on the nodes (besides Sluice's own: the Prefect API, telemetry off), e.g. AWS credentials."""
    rollout: RolePlacement = RolePlacement()
    """Where the rollout role runs (with its embedded inference server, when it has one)."""
    reward: RolePlacement = RolePlacement()
    """Where the reward role runs."""
    train: RolePlacement = RolePlacement()
    """Where the train role runs (rank 0 of a split trainer)."""
    evaluate: RolePlacement = RolePlacement()
    """Where the evaluate role runs."""
    servers: RolePlacement = RolePlacement()
    """Where each inference server runs (`servers.launch: ray`): every server is one Ray actor asking for this much (its GPUs: `num_gpus`, or `servers.gpus_per_server` when that is 0)."""

    def placement(self, role: str) -> RolePlacement:
        """The placement of `role` (rollout, reward, train, evaluate or servers; the colocated
        `sync` baseline trains, so it goes where `train` goes)."""
        found = getattr(self, "train" if role == "sync" else role, None)
        if not isinstance(found, RolePlacement):
            raise KeyError(f"no placement for role {role!r}")
        return found


def url_scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def cluster_requirements(cluster: ClusterConfig, storage_url: str, tracking_uri: str) -> list[str]:
    """What a run on `cluster` lacks, one line each (empty: nothing).

    A one-node instance (`address` None) runs every process on this machine, so local
    storage and a sqlite tracking file serve it; a cluster that may span machines needs
    storage and a tracking server every node reaches.
    """
    if cluster.engine != "ray" or cluster.address is None:
        return []
    missing = []
    scheme = url_scheme(storage_url)
    if scheme == "memory":
        missing.append(
            f"storage.url={storage_url} lives inside one process; a Ray cluster needs "
            "storage every node reaches (s3://bucket/prefix)"
        )
    elif scheme in ("file", ""):
        path = storage_url.removeprefix("file://")
        if not cluster.shared_filesystem:
            missing.append(
                f"storage.url={storage_url} is this machine's disk; a Ray cluster needs "
                "storage every node reaches: s3://bucket/prefix, or a shared file system "
                "mounted at the same path on every node (cluster.shared_filesystem=true)"
            )
        elif not path.startswith("/"):
            missing.append(
                f"storage.url={storage_url} is a relative path; on a shared file system "
                "give the absolute path every node mounts (file:///shared/sluice)"
            )
    elif scheme not in SHARED_STORAGE_SCHEMES:
        missing.append(
            f"storage.url={storage_url}: Sluice cannot tell whether every node reaches "
            f"'{scheme}://'; use s3:// (or a shared file system with file://)"
        )
    if url_scheme(tracking_uri) in LOCAL_TRACKING_SCHEMES:
        missing.append(
            f"tracking.uri={tracking_uri} is a file on this machine; a Ray cluster needs "
            "a tracking server every node reaches (mlflow server ...; "
            "tracking.uri=http://HOST:5000)"
        )
    return missing
