"""The built-in inference server as a child process of the rollout role.

Kept apart from tasks/rollout/role.py, whose imports (MLflow, Arrow, a tokenizer) take
seconds: the rollout role starts the server first (`start_early`) so the server's own
start-up overlaps everything else the roles do before the first prompt is generated.
Every server asks for the run's token, read from its 0600 file (tasks/run/credential.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sluice.infra.config.run import RunConfig
from sluice.infra.docker_servers import SLUICE_IMAGE, ServerSpec
from sluice.infra.serving.client import InferenceClient
from sluice.tasks.process.launcher import PYTHON, start_forked_or_fresh
from sluice.tasks.process.ports import free_port
from sluice.tasks.run.control import START_FILE
from sluice.tasks.run.credential import run_token, token_path
from sluice.tasks.run.paths import read_json, run_paths
from sluice.tasks.run.threads import role_threads

log = logging.getLogger("sluice.rollout")


def server_spec(
    config: RunConfig,
    port: int,
    model_dir: Path,
    weight_version: int,
    gpus: tuple[int, ...],
    mounts: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    api_key_file: Path | None = None,
    weight_master_addresses: tuple[str, ...] = (),
) -> ServerSpec:
    """One server's command and resources, from the run's config; `api_key_file`: the
    run's token file, which the server reads (None: open to every caller)."""
    launch = config.servers
    return ServerSpec(
        engine=launch.engine,
        image=launch.image or SLUICE_IMAGE,
        model_dir=str(model_dir.resolve()),
        port=port,
        weight_version=weight_version,
        mounts=mounts,
        gpus=gpus,
        seed=config.seed,
        dtype=config.rollout.dtype,
        device="cuda" if gpus else "cpu",
        max_batch_size=config.rollout.max_batch_size,
        max_seq_len=config.rollout.max_seq_len,
        num_threads=None if gpus else role_threads(config, "rollout"),
        extra_args=tuple(launch.extra_args),
        host=host,
        lora_rank=config.trainer.lora.rank,
        lora_target_modules=tuple(config.trainer.lora.target_modules),
        api_key_file=None if api_key_file is None else str(api_key_file),
        weight_master_addresses=weight_master_addresses,
    )


class EmbeddedServer:
    """The built-in SGLang-compatible server, as a child process of the rollout role."""

    def __init__(
        self,
        config: RunConfig,
        model_dir: Path,
        weight_version: int,
        log_dir: Path,
        api_key_file: Path | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_dir = Path(model_dir)
        self.weight_version = weight_version
        log_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--weight-version",
            str(weight_version),
            "--max-batch-size",
            str(config.rollout.max_batch_size),
            "--seed",
            str(config.seed),
            "--device",
            config.device,
            "--dtype",
            config.rollout.dtype,
            "--num-threads",
            str(role_threads(config, "rollout")),
            "--weight-noise-std",
            str(config.rollout.weight_noise_std),
            "--exit-with-parent",
        ]
        if config.rollout.max_seq_len is not None:
            argv += ["--max-seq-len", str(config.rollout.max_seq_len)]
        if api_key_file is not None:  # the path, never the token, on the command line
            argv += ["--api-key-file", str(api_key_file)]
        from sluice.infra.serving.server import main as serve_main

        self.process = start_forked_or_fresh(
            serve_main,
            argv,
            log_dir / "inference-server.log",
            [*PYTHON, "-m", "sluice.infra.serving.server", *argv],
        )

    def stop(self) -> None:
        self.process.stop(grace_s=10)


def embedded_server(
    config: RunConfig, run_id: str, model_dir: Path, weight_version: int
) -> EmbeddedServer:
    """The run's embedded server on `weight_version`, asking for the run's token."""
    run_token(config, run_id)  # the flow's, or one minted here for a role started alone
    log_dir = Path(config.workdir) / "runs" / run_id / "logs"
    return EmbeddedServer(config, model_dir, weight_version, log_dir, token_path(config, run_id))


def run_client(
    config: RunConfig, run_id: str, urls: list[str], timeout_s: float
) -> InferenceClient:
    """A client of the run's servers that sends the run's token with every request.
    External servers (`rollout.server_urls`) are not the run's: they are never sent it
    (whoever runs them could call the run's weight sender with it)."""
    token = None if config.rollout.server_urls else run_token(config, run_id)
    return InferenceClient(urls, timeout_s=timeout_s, api_key=token)


def local_checkpoint_dir(uri: str) -> Path | None:
    """The directory of a checkpoint on the local filesystem, None for remote storage."""
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    if "://" not in uri:
        return Path(uri)
    return None


def start_early(config: RunConfig, run_id: str) -> EmbeddedServer | None:
    """Start the embedded server on the run's starting version before anything else loads.

    Only for the embedded server and a checkpoint already on local disk; otherwise
    (external servers, remote storage, no start document) the rollout role starts it
    the usual way once it has fetched the weights. The role checks the version
    against the registry and updates the server if they differ.
    """
    if config.rollout.server_urls or config.servers.launch != "embedded":
        return None
    start: dict[str, Any] | None = read_json(
        config, f"{run_paths(config, run_id).control}/{START_FILE}"
    )
    if not start:
        return None
    model_dir = local_checkpoint_dir(str(start.get("checkpoint_uri", "")))
    if model_dir is None or not (model_dir / "config.json").is_file():
        return None
    log.info("starting the inference server on policy version %s", start["policy_version"])
    return embedded_server(config, run_id, model_dir, int(start["policy_version"]))
