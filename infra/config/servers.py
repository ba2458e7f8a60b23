"""The `servers` section: the inference servers a run starts itself (`launch: docker` or
`ray`), and how a committed full-weight version's bytes reach them
(`servers.weight_transfer`; docs/design.md §2.1), with `auto` resolved by placement."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from sluice.infra.config.section import Section

if TYPE_CHECKING:
    from sluice.infra.config.run import RunConfig


class ServersConfig(Section):
    """Inference servers the run starts itself (`launch: docker` or `ray`)."""

    launch: Literal["embedded", "docker", "ray"] = "embedded"
    """`embedded`: the rollout role serves from a child process of its own, or talks to
    `rollout.server_urls` when they are given. `docker`: the run starts `count` server containers on
    host networking (a Docker engine on the flow's machine), waits on their health, hands their URLs
    to the rollout role, restarts one that dies and removes them all when the run ends or fails.
    `ray` (needs `cluster.engine: ray`): `count` servers as Ray actors, each on a node that offers
    `cluster.servers`; each fetches the weights it serves onto its own node, and one that dies (or
    loses its node) is started again wherever the cluster has room."""
    count: int = Field(1, ge=1, le=64)
    """Servers; the rollout role spreads groups over them, least-loaded first."""
    engine: Literal["sluice", "sglang"] = "sluice"
    """`sluice`: Sluice's own server (`python -m sluice.infra.serving.server`, CPU or CUDA) from
    `image`. `sglang`: SGLang's `launch_server` from an SGLang image, with `gpus_per_server` GPUs
    each (its tensor-parallel size)."""
    image: str | None = None
    """Image of the server containers (`launch: docker`; Ray actors run in the nodes' own Python
    environment); None = `sluice:local` for the sluice engine (`bash infra/docker/image.sh` builds
    it). The sglang engine needs one named (e.g. SGLang's release image for your CUDA)."""
    gpus_per_server: int = Field(0, ge=0, le=64)
    """GPUs of each server (a container gets GPUs i*n .. i*n+n-1; a Ray actor asks its node for n GPUs, unless `cluster.servers.num_gpus` says otherwise); 0 = CPU only (sluice engine)."""
    extra_args: list[str] = []
    """More flags for each server's command line (e.g. `--mem-fraction-static 0.7` for SGLang)."""
    start_timeout_s: float = Field(600.0, gt=0)
    """How long a server may take to answer /health after its container or actor starts."""
    max_restarts: int = Field(3, ge=0, le=1000)
    """Times one server is restarted after it died before the run fails."""
    weight_transfer: Literal["auto", "disk", "distributed", "shared_memory"] = "auto"
    """How a committed full-weight version's bytes reach the servers (the registry gates which
    version, whatever the path). `disk`: the checkpoint files (`/update_weights_from_disk`).
    `distributed`: the trainer broadcasts them over a process group it forms with every server (gloo
    on CPU, NCCL on GPU; SGLang's `/update_weights_from_distributed`; verl's and slime's NCCL
    refit). `shared_memory`: servers on the trainer's host map the trainer's copy (shared memory on
    CPU, CUDA IPC on GPU; `/update_weights_from_tensor`). `auto`: on GPUs, shared memory (CUDA IPC)
    for the embedded server and a group for launched (docker, Ray) servers; disk on CPUs (where the
    page cache serves the checkpoint as fast: docs/reports/2026-11-27-weight-sync.md), for servers
    given by URL, and for LoRA, Megatron or multi-rank trainers. Any failure of a fast path loads
    that version from disk instead, and the next version tries again. A LoRA run's adapters always
    go as adapters (`/load_lora_adapter`: megabytes)."""
    weight_bucket_mb: float = Field(256.0, gt=0)
    """Largest bucket of a `distributed` transfer (MiB): one broadcast each; bigger buckets mean fewer calls and more memory on each server while it receives."""
    weight_group_timeout_s: float = Field(60.0, gt=0)
    """Deadline of every collective of a weight group: forming it, and each bucket sent. A server or trainer that dies mid-transfer ends the transfer within this, and the version loads from disk."""

    @model_validator(mode="after")
    def _engine_settings(self) -> ServersConfig:
        if (
            self.engine == "sglang"
            and self.weight_transfer == "shared_memory"
            and not self.gpus_per_server
        ):
            raise ValueError(
                "servers.weight_transfer=shared_memory with SGLang needs GPUs (CUDA IPC)"
            )
        if self.engine == "sglang" and self.image is None and self.launch != "ray":
            raise ValueError(
                "servers.engine=sglang in containers needs servers.image (an SGLang image)"
            )
        if self.engine == "sglang" and self.gpus_per_server < 1:
            raise ValueError("servers.engine=sglang needs servers.gpus_per_server >= 1")
        return self


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
