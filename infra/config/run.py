"""The whole run's configuration (`RunConfig`) and `load_config`, which builds one from a
YAML file plus `--set key=value` overrides.

A run is described by a YAML file (``flows/configs/*.yaml``) plus overrides, validated
here before anything heavy (torch, Prefect, MLflow) is imported, so a typo costs
milliseconds and one line of error, not a minute of start-up. Each section is a model of
its own module in this package (its ``__init__`` has the map); this one holds the
top-level keys and the checks that span sections.

Every field has a docstring: Prefect renders them in the UI when the config is a flow
parameter, the resolved config is logged to MLflow for each run, and
``docs/config-reference.md`` lists them all (``python -m sluice.infra.config.reference``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sluice.infra.config.checkpoint import CheckpointConfig
from sluice.infra.config.cluster import ClusterConfig, cluster_requirements
from sluice.infra.config.episode import EpisodeConfig
from sluice.infra.config.evaluation import EvaluationConfig
from sluice.infra.config.model import ModelConfig
from sluice.infra.config.overrides import (
    ConfigError,
    apply_override,
    format_validation_error,
    read_config_file,
)
from sluice.infra.config.problem import ProblemConfig, check_verifier
from sluice.infra.config.reward import RewardConfig
from sluice.infra.config.rollout import RolloutConfig
from sluice.infra.config.servers import ServersConfig
from sluice.infra.config.staleness import Mode, StalenessConfig, apply_mode, dotted_keys
from sluice.infra.config.storage import StorageConfig
from sluice.infra.config.tracking import TrackingConfig
from sluice.infra.config.trainer import TrainerConfig
from sluice.infra.secrets import remember_secrets

CONFIG_DIR = Path(__file__).resolve().parents[2] / "flows" / "configs"
"""The built-in run configs (`sluice train --config NAME`)."""


class RunConfig(BaseModel):
    """A whole Sluice run."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )

    name: str = Field("sluice", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
    """Run name. Each run's id is `{name}-{UTC start time}-{4 hex}` (or the id given to `--resume`), and its streams, checkpoints and control files live under `{storage.url}/{run id}`."""
    seed: int = 0
    """Seeds prompts, sampling, initialisation and training."""
    mode: Mode | None = None
    """verl's fully-async modes by name: `on_policy` (eta 0), `one_step_off` (eta 1), `stream` (eta
    3, a version every 4 steps), `stale` (eta 5, a version every 4 steps), `partial` (as `stale`,
    interrupting generation for each update). Sets `staleness.max_staleness`,
    `trainer.publish_every` and `rollout.interruptible` (infra/config/staleness.py has the table and
    why); a key set explicitly still wins, and the run logs the values it resolved. None = those
    keys as given."""
    workdir: str = ".sluice"
    """Local directory for caches (warm-start model, fetched checkpoints)."""
    device: Literal["cpu", "cuda", "auto"] = "auto"
    """Where every role computes: the embedded inference server, the trainer, the sync baseline and evaluation. `auto` = cuda when a GPU is visible, else cpu."""
    threads_per_role: int | None = Field(None, ge=1, le=1024)
    """torch intra-op threads of each role process (inference server, trainer, evaluator). None =
    half the CPU cores (at least 1), since generation and training run side by side; the colocated
    sync baseline takes all cores. More threads than cores makes every role spin and slows the run
    several-fold."""
    role_retries: int = Field(2, ge=0, le=10000)
    """Times a role whose process failed (crashed, killed, an outage it could not ride out) is
    started again before the run fails; each restart resumes from the role's ledger and the
    registry. On a Ray cluster, also the times a role whose node was lost is placed again, counted
    apart (the trainer's is a failover, from the newest committed version on storage); past it the
    run stops with one line, resumable."""
    outage_timeout_s: float = Field(600.0, gt=0, le=7 * 86400)
    """Seconds a role waits for the object store or the tracking server to answer again once it
    stopped answering (after the client libraries' own retries with backoff); the wait costs none of
    `role_retries`. Longer, and the run stops with one line naming the service, to be continued with
    `sluice train --resume`. Short loses a run to a long blip; long keeps a run idle through a real
    outage."""
    model: ModelConfig = ModelConfig()
    """The policy model."""
    problem: ProblemConfig = ProblemConfig()
    """Prompts."""
    rollout: RolloutConfig = RolloutConfig()
    """Generation."""
    episode: EpisodeConfig = EpisodeConfig()
    """Multi-turn episodes with tool calls (off unless `episode.tools` names one)."""
    servers: ServersConfig = ServersConfig()
    """Inference servers the run starts itself (containers)."""
    staleness: StalenessConfig = StalenessConfig()
    """Staleness bound."""
    reward: RewardConfig = RewardConfig()
    """Scoring."""
    trainer: TrainerConfig = TrainerConfig()
    """Optimisation."""
    evaluation: EvaluationConfig = EvaluationConfig()
    """Held-out evaluation."""
    storage: StorageConfig = StorageConfig()
    """Object storage for streams and checkpoints."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """When served policy versions become durable (trainer state and all)."""
    tracking: TrackingConfig = TrackingConfig()
    """MLflow tracking and registry."""
    cluster: ClusterConfig = ClusterConfig()
    """Where the roles run: this machine (default) or a Ray cluster."""

    @model_validator(mode="before")
    @classmethod
    def _mode_presets(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mode") is not None:
            data = copy.deepcopy(data)
            apply_mode(data)  # keys given in `data` win
        return data

    @model_validator(mode="after")
    def _cluster_reaches_services(self) -> RunConfig:
        missing = cluster_requirements(self.cluster, self.storage.url, self.tracking.uri)
        if missing:
            raise ValueError(f"cluster.engine=ray at {self.cluster.address}: {missing[0]}")
        return self

    @model_validator(mode="after")
    def _reasoning_gym_verifier(self) -> RunConfig:
        uses_rg = self.problem.name == "reasoning_gym" and not self.problem.dataset
        if uses_rg and self.reward.verifier in ("builtin", "math", "code"):
            raise ValueError(
                "problem.name=reasoning_gym is scored by reward.verifier=reasoning_gym "
                f"(not {self.reward.verifier})"
            )
        if self.reward.numeric_closeness and self.reward.verifier != "reasoning_gym":
            raise ValueError(
                f"reward.numeric_closeness is partial credit of reward.verifier=reasoning_gym, not {self.reward.verifier}"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer(self) -> RunConfig:
        buffer, cap = self.reward.overlong_buffer_tokens, self.rollout.max_new_tokens
        if buffer and buffer >= cap:
            raise ValueError(
                f"reward.overlong_buffer_tokens={buffer} must be below "
                f"rollout.max_new_tokens={cap}: the penalty ramps over the last tokens before the cap"
            )
        return self

    @model_validator(mode="after")
    def _supervised_pass(self) -> RunConfig:
        minutes, budget = self.model.supervised.minutes, self.trainer.time_budget_s
        if minutes and self.episode.tools:
            raise ValueError(
                "model.supervised trains single-turn answers; turn it off with episode.tools"
            )
        if minutes and budget is not None and minutes * 60 >= budget:
            raise ValueError(
                f"model.supervised.minutes={minutes:g} leaves RL none of "
                f"trainer.time_budget_s={budget:g}"
            )
        return self

    @model_validator(mode="after")
    def _humaneval_verifier(self) -> RunConfig:
        check_verifier(self.problem, self.reward.verifier)
        return self

    @model_validator(mode="after")
    def _launched_servers(self) -> RunConfig:
        launch = self.servers.launch
        if launch == "embedded":
            return self
        if launch == "ray" and self.cluster.engine != "ray":
            raise ValueError(
                "servers.launch=ray places the servers on the run's Ray cluster; "
                "set cluster.engine=ray (and cluster.address) or use servers.launch=docker"
            )
        if self.rollout.server_urls:
            raise ValueError(
                f"servers.launch={launch} starts the run's own servers; "
                "unset rollout.server_urls or set servers.launch=embedded"
            )
        if self.rollout.weight_noise_std:
            raise ValueError(
                "rollout.weight_noise_std is applied by the embedded inference server only; "
                "set servers.launch=embedded or rollout.weight_noise_std=0"
            )
        return self

    @model_validator(mode="after")
    def _weight_transfer(self) -> RunConfig:
        chosen = self.servers.weight_transfer
        if chosen in ("distributed", "shared_memory") and (
            self.trainer.world_size > 1 or self.trainer.backend != "torch"
        ):
            raise ValueError(
                f"servers.weight_transfer={chosen} sends the Hugging Face weights of one torch "
                f"trainer process; with trainer.backend={self.trainer.backend} and "
                f"trainer.world_size={self.trainer.world_size} use disk or auto"
            )
        if chosen == "shared_memory" and (
            self.servers.launch != "embedded" or self.rollout.server_urls
        ):
            raise ValueError(
                "servers.weight_transfer=shared_memory maps the trainer's memory: only the "
                "embedded server shares its host and /dev/shm; use distributed or auto"
            )
        return self


# ---------------------------------------------------------------- loading


def resolve_config_path(name_or_path: str | None) -> Path | None:
    """A config file path, or the name of a config in flows/configs (with or without .yaml)."""
    if name_or_path is None:
        return None
    path = Path(name_or_path)
    if path.exists():
        return path
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.exists():
            return candidate
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(
        f"config file '{name_or_path}' not found (built-in configs: {', '.join(known)})"
    )


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Load a YAML config (or defaults), apply `key=value` overrides, validate.

    Raises ConfigError with one line naming the bad key or value.
    """
    data: dict[str, Any] = {}
    source = "config"
    resolved = resolve_config_path(str(path)) if path is not None else None
    if resolved is not None:
        source = str(resolved)
        data = read_config_file(resolved)
    from_file = dotted_keys(data)
    for assignment in overrides:
        apply_override(data, assignment, RunConfig)
    # A mode fills the keys it presets unless they were set at its own layer or later.
    set_keys = {a.partition("=")[0].strip() for a in overrides}
    apply_mode(data, set_keys if "mode" in set_keys else set_keys | from_file)
    if overrides:
        source = f"{source} with --set" if resolved else "--set"
    remember_secrets(data)  # no error line of this process shows them (infra/secrets.py)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source, RunConfig)) from None
