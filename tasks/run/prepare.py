"""Policy version 0: the user's model (after its supervised pass, when the config asks
for one), the shipped warm policy, or a warm start run once.

The embedded default starts from the warm-started ~1M-parameter Llama that ships in
the package (engines/policy/shipped_policy.py rebuilds it byte for byte), so `sluice train`
goes straight to RL. Another tiny shape or task builds a Llama from config plus a
character tokenizer (no hub download) and runs a short supervised pass on the built-in
task with problem sizes drawn uniformly (docs/design.md §4: warm-starting on the
long-tailed distribution itself memorised the short answers and left RL nothing to
climb); that result is cached under `workdir/models/` by a hash of everything that
shapes it, so only the first run pays for it. A user's model with
`model.supervised.minutes` first trains on the training prompts' reference answers,
each prompt encoded as the rollout encodes it (SFT, then RL); that pass is the run's
own, on the run's clock, and nothing of it is cached. Version 0 is committed to the
registry only after its checkpoint is durable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from sluice.engines.policy import shipped_policy
from sluice.engines.policy.model import build_tiny_policy, resolve_device
from sluice.engines.policy.supervised import supervised_pass
from sluice.engines.policy.warm_checks import EpisodeCheck
from sluice.engines.policy.warmstart import warm_start
from sluice.infra.checkpoints import save_checkpoint
from sluice.infra.config.run import RunConfig
from sluice.infra.tracking import log_metrics
from sluice.tasks.prompts import (
    PromptSource,
    build_problem,
    load_policy_tokenizer,
    reference_examples,
)
from sluice.tasks.run.paths import run_paths, run_registry
from sluice.tasks.run.status import flow_reporter
from sluice.tasks.tool_runner import episode_spec, plain_tool

log = logging.getLogger("sluice.prepare")


def warm_cache_key(config: RunConfig) -> str:
    shaping = {
        "tiny": config.model.tiny.model_dump(),
        "problem": config.problem.name,
        "seed": config.seed,
        "target": config.model.warm_start_target_accuracy,
        "minutes": config.model.warm_start_max_minutes,
        "steps": config.model.warm_start_max_steps,
        "eval_every": config.model.warm_start_eval_every,
        "max_new_tokens": config.rollout.max_new_tokens,
        "format": 2,  # 2: the warm-start corpus mixes bare answers with worked sums
    }
    if config.episode.tools:  # the held-out check runs episodes with these tools
        shaping["episode"] = config.episode.model_dump()
        shaping["corpus"] = repr(build_problem(config))  # the warm-start mix
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]


def shipped_policy_applies(config: RunConfig) -> bool:
    """Whether the config asks for exactly the policy that ships with Sluice."""
    build = shipped_policy.BUILD
    return (
        config.model.shipped_policy
        and config.model.path is None
        and config.problem.dataset is None
        and config.problem.name == build.problem
        and config.model.tiny.model_dump() == build.tiny_shape()
        and (shipped_policy.SHIPPED_DIR / "config.json").is_file()
    )


def initial_policy_dir(
    config: RunConfig, say: Any = log.info, run_id: str = "prepare"
) -> tuple[Path, dict[str, Any]]:
    """The directory of policy version 0 and a few facts about how it was made."""
    if config.model.path and config.model.supervised.minutes:
        return supervised_policy(config, Path(config.workdir) / "runs" / run_id / "sft", say)
    if config.model.path:
        return Path(config.model.path), {"source": "user", "path": config.model.path}
    if shipped_policy_applies(config):
        path = shipped_policy.SHIPPED_DIR
        return path, {"source": "shipped-warm-policy", "path": str(path)}
    key = warm_cache_key(config)
    models = Path(config.workdir) / "models"
    base = models / f"tiny-{key}"
    tiny = config.model.tiny
    if not (base / "config.json").exists():
        build_tiny_policy(
            base,
            arch=tiny.arch,
            hidden_size=tiny.hidden_size,
            num_layers=tiny.num_layers,
            num_heads=tiny.num_heads,
            intermediate_size=tiny.intermediate_size,
            max_position_embeddings=tiny.max_position_embeddings,
            seed=config.seed,
        )
    if not config.model.warm_start:
        return base, {"source": "tiny-random", "path": str(base)}
    warm = models / f"warm-{key}"
    target = config.model.warm_start_target_accuracy
    report = warm_start(
        base,
        build_problem(config),
        seed=config.seed,
        steps=config.model.warm_start_max_steps,
        max_minutes=config.model.warm_start_max_minutes,
        eval_every=config.model.warm_start_eval_every,
        target_accuracy=(target, min(1.0, target + 0.15)),
        out_dir=warm,
        max_new_tokens=config.rollout.max_new_tokens,
        progress=say,
        episodes=warm_start_episodes(config, base),
    )
    facts = {
        "source": "tiny-warm-start",
        "path": str(warm),
        "warm_start_accuracy": report.final_accuracy,
        "warm_start_steps": report.steps,
        "warm_start_cached": report.cached,
        "warm_start_wall_time_s": report.wall_time_s,
    }
    return warm, facts


def supervised_policy(config: RunConfig, out: Path, say: Any) -> tuple[Path, dict[str, Any]]:
    """The user's model after `model.supervised`'s pass, saved in `out`."""
    model_dir = Path(str(config.model.path))
    settings = config.model.supervised
    source = PromptSource(config).use_policy(model_dir)
    assert source.tokenizer is not None  # use_policy set it
    end = source.tokenizer.eos_token_id
    end = source.stop_token_ids[0] if end is None and source.stop_token_ids else end
    if end is None:
        raise ValueError(f"{model_dir}: a supervised pass needs an end token; the model has none")
    say(
        f"supervised pass: {settings.minutes:g} min at lr {settings.lr:g}, "
        f"{settings.batch_size} rows a step, on the reference answers of the training prompts"
    )
    report = supervised_pass(
        model_dir,
        reference_examples(source, int(end)),
        out,
        minutes=settings.minutes,
        lr=settings.lr,
        batch_size=settings.batch_size,
        max_steps=settings.max_steps,
        seed=config.seed,
        device=resolve_device(config.device),
        max_tokens_per_micro_batch=config.trainer.max_tokens_per_micro_batch,
        progress=say,
    )
    say(f"supervised pass done: {report.steps} steps in {report.wall_time_s:.0f} s")
    facts = {f"supervised_{key}": value for key, value in report.facts().items()}
    facts["supervised_loss_by_minute"] = report.loss_by_minute
    return out, {"source": "user-supervised", "path": str(out), **facts}


def warm_start_episodes(config: RunConfig, base: Path) -> EpisodeCheck | None:
    """How the warm start checks a multi-turn policy: greedy episodes with the run's
    tools (None for single-turn runs)."""
    if not config.episode.tools:
        return None
    spec = episode_spec(config, load_policy_tokenizer(base))
    return EpisodeCheck(spec, plain_tool(config))


def ensure_version_zero(
    config: RunConfig, run_id: str, mlflow_run_id: str, say: Any = log.info
) -> dict[str, Any]:
    registry = run_registry(config, run_id)
    latest = registry.newest_durable()
    if latest is not None:
        say(f"resuming from committed policy version {latest.policy_version}")
        return {
            "policy_version": latest.policy_version,
            "checkpoint_uri": latest.checkpoint_uri,
            "resumed": True,
        }
    model_dir, facts = initial_policy_dir(config, say, run_id)
    uri = save_checkpoint(
        model_dir, run_paths(config, run_id).checkpoint(0), storage_options=config.storage.options
    )
    losses = facts.pop("supervised_loss_by_minute", [])
    for minute, loss in enumerate(losses, start=1):  # the pass's curve, beside RL's metrics
        log_metrics(config.tracking.uri, mlflow_run_id, {"supervised/loss": loss}, step=minute)
    tags = {k: v for k, v in facts.items() if k != "path"}
    registry.commit(0, uri, run_id=mlflow_run_id, tags=tags, trainer_step=0)
    if facts["source"] == "user-supervised":  # committed from storage: the local copy goes
        shutil.rmtree(model_dir, ignore_errors=True)
    say(f"policy version 0 committed: {uri} ({facts['source']})")
    return {"policy_version": 0, "checkpoint_uri": uri, "resumed": False, **facts}


@task(name="prepare-policy", retries=1, cache_policy=NO_CACHE, persist_result=False)
def prepare_policy(config: dict[str, Any], run_id: str, mlflow_run_id: str) -> dict[str, Any]:
    """Build/warm-start the initial policy if needed and commit it as version 0."""
    logger = get_run_logger()
    run_config = RunConfig.model_validate(config)
    # A supervised pass or a warm start may take many minutes before any role starts:
    # each progress line also goes to the flow's status document, for `sluice status`.
    status = flow_reporter(run_config, run_paths(run_config, run_id))
    status.update(state="preparing", activity="preparing policy version 0")

    def say(line: str) -> None:
        logger.info(line)
        status.update(state="preparing", activity=line)

    return ensure_version_zero(run_config, run_id, mlflow_run_id, say)
