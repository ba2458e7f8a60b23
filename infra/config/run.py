"""The run configuration: one pydantic model for everything a Sluice run needs.

A run is described by a YAML file (``flows/configs/*.yaml``) plus ``--set key=value``
overrides, validated here before anything heavy (torch, Prefect, MLflow) is imported,
so a typo costs milliseconds and one line of error, not a minute of start-up.

Every field has a docstring: Prefect renders them in the UI when the config is a flow
parameter, and the resolved config is logged to MLflow for each run.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sluice.engines.inference.types import PauseMode
from sluice.infra.checkpoint_config import CheckpointConfig
from sluice.infra.cluster_config import ClusterConfig, cluster_requirements
from sluice.infra.config_overrides import (
    ConfigError,
    apply_override,
    format_validation_error,
    read_config_file,
)
from sluice.infra.model_config import ModelConfig, TinyModelConfig  # noqa: F401
from sluice.infra.problem_config import (
    CurriculumStage,
    HumanEvalConfig,
    ReasoningGymConfig,
    check_verifier,
)
from sluice.infra.problem_config import Section as _Section
from sluice.infra.run_modes import Mode, apply_mode, dotted_keys
from sluice.infra.secrets import remember_secrets
from sluice.infra.tracking_config import TrackingConfig
from sluice.infra.trainer_config import (  # noqa: F401  (importable from here as before)
    AdvantageConfig,
    CorrectionConfig,
    LossConfig,
    TrainerConfig,
)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "flows" / "configs"


class ProblemConfig(_Section):
    """What the policy is asked to solve."""

    name: str = "longtail_sum"
    """Built-in task name, used when `dataset` is None: `longtail_sum`, `tool_arith`, `reasoning_gym` (the tasks of `reasoning_gym`) or `humaneval` (HumanEval's 164 problems, scored by `reward.verifier: code`)."""
    dataset: str | None = None
    """A .jsonl or .parquet file of rows with `prompt` and `answer` (extra columns reach the verifier)."""
    reasoning_gym: ReasoningGymConfig = ReasoningGymConfig()
    """Tasks, mix, prompt instruction and answer format of `name: reasoning_gym` (docs/configuration.md)."""
    humaneval: HumanEvalConfig = HumanEvalConfig()
    """Extraction, instruction and held-out split of `name: humaneval` (docs/configuration.md)."""
    curriculum: list[CurriculumStage] = []
    """Training prompts from small problems first: stages in order of `until_step`, each bounding the size of the training prompts drawn for its steps; after the last stage, the whole mix. The held-out prompts are always the whole mix. Empty = no curriculum. (verl and TRL leave curricula to the dataset; reasoning-gym ships per-task curricula of the same kind.)"""
    curriculum_clock: Literal["issued", "trained"] = "issued"
    """What a stage's `until_step` counts. `issued`: a group's issue number // `trainer.prompts_per_batch`, the same prompts on every run of a seed. `trained`: the policy version generating the group, i.e. trained steps, so a stage lasts as written even when dynamic sampling draws several groups per kept one. The sync flow's step is both."""

    @model_validator(mode="after")
    def _reasoning_gym_tasks(self) -> ProblemConfig:
        if self.name == "reasoning_gym" and not self.dataset and not self.reasoning_gym.tasks:
            raise ValueError("problem.name=reasoning_gym needs problem.reasoning_gym.tasks")
        steps = [stage.until_step for stage in self.curriculum]
        if steps != sorted(set(steps)):
            raise ValueError(
                f"problem.curriculum: until_step must increase from stage to stage, got {steps}"
            )
        return self


class RolloutConfig(_Section):
    """Generation: sampling, group size, inference servers, weight reloads."""

    group_size: int = Field(8, ge=1, le=1024)
    """Responses sampled per prompt (G in GRPO)."""
    max_new_tokens: int = Field(256, ge=1)
    """Longest response, in tokens; longer ones end with finish_reason=length."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer recomputes log-probs at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling (-1 = off)."""
    server_urls: list[str] = []
    """SGLang-compatible servers. Empty starts the embedded inference server in the rollout process."""
    max_batch_size: int = Field(64, ge=1)
    """Concurrent sequences in the embedded engine (continuous-batching slots)."""
    max_seq_len: int | None = Field(None, ge=2)
    """Prompt + response tokens each slot of Sluice's engine holds (its KV cache is `max_batch_size` x this); a longer prompt is passed over for the group's next draw. None: the model's positions, at most 2048. Size it to the longest prompt plus `max_new_tokens`: at 2048 x 64 slots, a 135M model's float32 KV cache alone is ~6 GB."""
    interruptible: bool = True
    """Pause in-flight generation for a weight update and recompute KV (True), or drain it first (False)."""
    pause_mode: PauseMode = PauseMode.RETRACT
    """How in-flight requests are held during a weight update when interruptible."""
    poll_interval_s: float = Field(0.5, gt=0)
    """How often the rollout role polls the registry alias for a newer committed version (and, at start, for the first one)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the inference engine wherever the policy generates: the embedded server, the sync baseline's engine and evaluation. The trainer keeps float32 weights and optimizer state; the decoupled loss corrects the difference (its behaviour log-probs come from this dtype). float32 on CPU."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Deadline of one generate request."""
    weight_noise_std: float = Field(0.0, ge=0, le=10)
    """Relative std of Gaussian noise added to every weight the embedded inference engine loads (w + σ·std(w)·N(0,1), seeded by run seed and policy version), to inject train–inference mismatch on purpose; the trainer and the evaluator keep clean weights. 0 = off (`sluice bench mismatch` sets it)."""

    @model_validator(mode="after")
    def _room_to_generate(self) -> RolloutConfig:
        if self.max_seq_len is not None and self.max_seq_len <= self.max_new_tokens:
            raise ValueError(
                f"rollout.max_seq_len ({self.max_seq_len}) must exceed rollout.max_new_tokens "
                f"({self.max_new_tokens}): a slot holds the prompt and the response"
            )
        return self


class EpisodeConfig(_Section):
    """Multi-turn episodes: the policy calls tools between turns (engines/env/episodes.py). Off while `tools` is empty: one response per sample."""

    tools: list[str] = []
    """Tools the policy may call: `calculator` (bounded arithmetic), `python` (the call runs as a program in the reward sandbox; its output is what it printed), or a user tool `module:function` taking the call's text and returning its output (imported in a worker process, run with `tool_timeout_s`). With several tools a call reads `name: input`. Empty: single-turn rollouts."""
    call_open: str = "["
    """Text that opens a tool call in the policy's output."""
    call_close: str = "]"
    """Text that closes a call and ends the turn; it must be one token of the policy's tokenizer (generation stops on it as on EOS), e.g. `</tool_call>` for Qwen."""
    observation_template: str = "> {output}\n"
    """How a tool's output is appended for the policy to read; `{output}` is replaced. These observation tokens are context: never trained (`loss_mask` 0)."""
    max_turns: int = Field(4, ge=1, le=64)
    """Most generate calls per episode; a call made on the last one is not run and the episode ends as truncated."""
    max_total_tokens: int = Field(256, ge=1)
    """Most response tokens per episode, generated and observed together; each turn generates at most `rollout.max_new_tokens` of them."""
    tool_timeout_s: float = Field(5.0, gt=0, le=3600)
    """Deadline of one tool call; a call past it shows the policy an error and is counted as a timeout."""
    tool_workers: int = Field(2, ge=1, le=256)
    """Worker processes that run user tools (calculator and python need none)."""
    shaping: str | None = None
    """Per-turn reward shaping: `module:function` called with an episode's turns (a list of dicts with `generated_tokens`, `call`, `outcome` (ok, error, timeout or None) and `observation_tokens`) and returning a number added to the final-answer reward, e.g. a small penalty per failed call. None: the final answer alone."""


class ServersConfig(_Section):
    """Inference servers the run starts itself (`launch: docker` or `ray`)."""

    launch: Literal["embedded", "docker", "ray"] = "embedded"
    """`embedded`: the rollout role serves from a child process of its own, or talks to `rollout.server_urls` when they are given. `docker`: the run starts `count` server containers on host networking (a Docker engine on the flow's machine), waits on their health, hands their URLs to the rollout role, restarts one that dies and removes them all when the run ends or fails. `ray` (needs `cluster.engine: ray`): `count` servers as Ray actors, each on a node that offers `cluster.servers`; each fetches the weights it serves onto its own node, and one that dies (or loses its node) is started again wherever the cluster has room."""
    count: int = Field(1, ge=1, le=64)
    """Servers; the rollout role spreads groups over them, least-loaded first."""
    engine: Literal["sluice", "sglang"] = "sluice"
    """`sluice`: Sluice's own server (`python -m sluice.infra.serving.server`, CPU or CUDA) from `image`. `sglang`: SGLang's `launch_server` from an SGLang image, with `gpus_per_server` GPUs each (its tensor-parallel size)."""
    image: str | None = None
    """Image of the server containers (`launch: docker`; Ray actors run in the nodes' own Python environment); None = `sluice:local` for the sluice engine (`bash infra/docker/image.sh` builds it). The sglang engine needs one named (e.g. SGLang's release image for your CUDA)."""
    gpus_per_server: int = Field(0, ge=0, le=64)
    """GPUs of each server (a container gets GPUs i*n .. i*n+n-1; a Ray actor asks its node for n GPUs, unless `cluster.servers.num_gpus` says otherwise); 0 = CPU only (sluice engine)."""
    extra_args: list[str] = []
    """More flags for each server's command line (e.g. `--mem-fraction-static 0.7` for SGLang)."""
    start_timeout_s: float = Field(600.0, gt=0)
    """How long a server may take to answer /health after its container or actor starts."""
    max_restarts: int = Field(3, ge=0, le=1000)
    """Times one server is restarted after it died before the run fails."""
    weight_transfer: Literal["auto", "disk", "distributed", "shared_memory"] = "auto"
    """How a committed full-weight version's bytes reach the servers (the registry gates which version, whatever the path). `disk`: the checkpoint files (`/update_weights_from_disk`). `distributed`: the trainer broadcasts them over a process group it forms with every server (gloo on CPU, NCCL on GPU; SGLang's `/update_weights_from_distributed`; verl's and slime's NCCL refit). `shared_memory`: servers on the trainer's host map the trainer's copy (shared memory on CPU, CUDA IPC on GPU; `/update_weights_from_tensor`). `auto`: on GPUs, shared memory (CUDA IPC) for the embedded server and a group for launched (docker, Ray) servers; disk on CPUs (where the page cache serves the checkpoint as fast: docs/reports/2026-11-27-weight-sync.md), for servers given by URL, and for LoRA, Megatron or multi-rank trainers. Any failure of a fast path loads that version from disk instead, and the next version tries again. A LoRA run's adapters always go as adapters (`/load_lora_adapter`: megabytes)."""
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


class StalenessConfig(_Section):
    """The admission rule floor(n / B) <= i + eta (docs/design.md §1)."""

    max_staleness: int = Field(4, ge=0, le=1000)
    """eta: how many policy versions behind a trained batch may be. 0 = synchronous."""


class RewardConfig(_Section):
    """Scoring of responses."""

    verifier: str = "builtin"
    """`builtin`, `math`, `code`, `reasoning_gym` (the task's own scoring, for `problem.name: reasoning_gym`), or an import path `package.module:function(row, response_text) -> float`."""
    correct_reward: float = 1.0
    """Reward of a verified-correct response."""
    incorrect_reward: float = 0.0
    """Reward of a wrong, unparsable or timed-out response."""
    num_workers: int = Field(1, ge=1, le=256)
    """Verifier worker processes."""
    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit per verifier call; a timeout scores `incorrect_reward`."""
    sandbox: Literal["auto", "process", "docker"] = "auto"
    """Where the `code` verifier runs model-written code: `docker` (a fresh container per run from `sandbox_image`: no network, read-only root, memory, CPU and pids limits, the deadline enforced from outside; needs a Docker engine, e.g. `bash infra/docker/engine.sh`, and refuses to start without one), `process` (a subprocess under kernel controls: a PID namespace, an unprivileged uid, Landlock and seccomp, with Python-level guards and rlimits; no engine needed; its start-up line names the controls this machine applies, docs/sandboxes.md), or `auto`: docker where an engine and the image answer, else process only where all four kernel controls apply (otherwise the role refuses to start in one line; set `process` to run model code there anyway). The `python` tool of multi-turn episodes runs in the same sandbox. Other verifiers run no code and start no sandbox."""
    sandbox_image: str = "sluice-base:bookworm"
    """Image of the docker sandbox's containers: any image with /usr/bin/python3 (`infra/docker/engine.sh` builds this one)."""
    sandbox_pool: int = Field(2, ge=0, le=64)
    """Containers the docker sandbox keeps started ahead: a run takes one (start-up is seconds, a run often less), so size it to the reward role's `num_workers`. 0 = start each run's container when it comes."""
    poll_interval_s: float = Field(0.25, gt=0)
    """How often the reward role lists the rollouts stream when it has nothing to score."""
    overlong_buffer_tokens: int = Field(0, ge=0)
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a response longer than `rollout.max_new_tokens` minus this many tokens loses reward linearly, down to `overlong_penalty` at the cap; 0 = off. Applied by the trainer before the advantages (`reward/shaping_mean`). verl: `reward_model.overlong_buffer.len`."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Reward lost by a response that reaches the cap (`overlong_buffer_tokens`). verl: `reward_model.overlong_buffer.penalty_factor`."""
    numeric_closeness: float = Field(0.0, ge=0, lt=1)
    """Partial credit kappa for a wrong numeric answer, training rewards only (`verifier: reasoning_gym`): it scores as if the task gave kappa * max(0, 1 - |answer - gold| / max(|gold|, 1)), so a group whose answers are all wrong still ranks them by how far off they are; held-out accuracy stays exact. 0 = off. No anchor has the key: verl and TRL take a custom reward function for this."""


class EvaluationConfig(_Section):
    """Held-out evaluation: during a run (the evaluate role) and after it (`sluice eval`)."""

    dataset: str | None = None
    """Held-out rows in the format of `problem.dataset`; None = a held-out split of the built-in task."""
    num_prompts: int = Field(64, ge=1)
    """Held-out prompts per evaluation."""
    samples: int = Field(1, ge=1)
    """Samples per held-out prompt at `temperature`; the held-out reward (`eval/reward`) and pass@1 are averaged over them."""
    pass_at_k: list[int] = [1]
    """k of the pass@k reported as `eval/pass_at_{k}`: the chance that at least one of k samples is correct, estimated without bias from all `samples` of each prompt (Chen et al. 2021); every k needs `samples >= k`, e.g. `[1, 5]` with `samples: 10`."""
    temperature: float | None = Field(None, ge=0)
    """Temperature of the held-out samples. None = the rollout temperature, so `eval/reward` is the RL objective (expected reward of the policy being trained) on unseen prompts; 0 = greedy decoding."""
    greedy: bool = True
    """Also decode every held-out prompt greedily and log `eval/greedy_accuracy` (one more decoding pass per evaluation; ignored when `temperature` is 0)."""
    every: int = Field(5, ge=0)
    """The evaluate role scores version 0, every N-th version and the final one (0 = version 0 and the final one)."""
    during_run: bool = True
    """Run the evaluate role beside training. False leaves every core to the compared roles; committed versions are evaluated afterwards (`sluice eval`, `sluice bench time-to-target`)."""
    poll_interval_s: float = Field(1.0, gt=0)
    """How often the evaluate role polls the registry for a version to score."""

    @model_validator(mode="after")
    def _pass_at_k_samples(self) -> EvaluationConfig:
        if any(not 1 <= k <= self.samples for k in self.pass_at_k):
            raise ValueError(f"pass_at_k {self.pass_at_k} needs k in 1..samples={self.samples}")
        return self


class StorageConfig(_Section):
    """Where streams and checkpoints live."""

    url: str = "file://.sluice/runs"
    """fsspec URL root: file://, s3://bucket/prefix, memory:// (tests)."""
    options: dict[str, Any] = {}
    """fsspec storage options (e.g. s3 endpoint_url, key, secret). Credentials here (key, secret, token, password, ... and those under client_kwargs) are redacted wherever the config leaves the process (MLflow, Prefect parameters, --dry-run, errors) and reach the roles only through 0600 files; better still, leave them out and give them in the environment (docs/operations.md, "Giving credentials")."""
    keep_versions: int | None = Field(3, ge=0)
    """Published policy versions whose weights stay on storage: the newest K (at least 2: the rollout side serves one while it fetches the next), plus every version an MLflow alias or a `sluice.keep` tag pins and every version the evaluation schedule has yet to score (docs/operations.md, "Checkpoints and retention"). Older ones are deleted after each durable commit and tagged `sluice.deleted`; the newest two durable versions' trainer states are kept. Versions that were only servable (`checkpoint.every_versions`) count among the newest K and go the same way. 0 or None = keep every version (at 135M parameters each is ~0.5 GB)."""

    @field_validator("keep_versions")
    @classmethod
    def _keep_two(cls, value: int | None) -> int | None:
        if value == 1:
            raise ValueError(
                "use 2 or more (0 keeps all): the rollout serves one while fetching the next"
            )
        return value


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
    """verl's fully-async modes by name: `on_policy` (eta 0), `one_step_off` (eta 1), `stream` (eta 3, a version every 4 steps), `stale` (eta 5, a version every 4 steps), `partial` (as `stale`, interrupting generation for each update). Sets `staleness.max_staleness`, `trainer.publish_every` and `rollout.interruptible` (infra/run_modes.py has the table and why); a key set explicitly still wins, and the run logs the values it resolved. None = those keys as given."""
    workdir: str = ".sluice"
    """Local directory for caches (warm-start model, fetched checkpoints)."""
    device: Literal["cpu", "cuda", "auto"] = "auto"
    """Where every role computes: the embedded inference server, the trainer, the sync baseline and evaluation. `auto` = cuda when a GPU is visible, else cpu."""
    threads_per_role: int | None = Field(None, ge=1, le=1024)
    """torch intra-op threads of each role process (inference server, trainer, evaluator). None = half the CPU cores (at least 1), since generation and training run side by side; the colocated sync baseline takes all cores. More threads than cores makes every role spin and slows the run several-fold."""
    role_retries: int = Field(2, ge=0, le=10000)
    """Times a role whose process failed (crashed, killed, an outage it could not ride out) is started again before the run fails; each restart resumes from the role's ledger and the registry. On a Ray cluster, also the times a role whose node was lost is placed again, counted apart (the trainer's is a failover, from the newest committed version on storage); past it the run stops with one line, resumable."""
    outage_timeout_s: float = Field(600.0, gt=0, le=7 * 86400)
    """Seconds a role waits for the object store or the tracking server to answer again once it stopped answering (after the client libraries' own retries with backoff); the wait costs none of `role_retries`. Longer, and the run stops with one line naming the service, to be continued with `sluice train --resume`. Short loses a run to a long blip; long keeps a run idle through a real outage."""
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
