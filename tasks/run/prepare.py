"""Policy version 0: the user's model, the shipped warm policy, or a warm start run once.

The embedded default starts from the warm-started ~1M-parameter Llama that ships in
the package (engines/policy/shipped_policy.py rebuilds it byte for byte), so `sluice train`
goes straight to RL. Another tiny shape or task builds a Llama from config plus a
character tokenizer (no hub download) and runs a short supervised pass on the built-in
task with problem sizes drawn uniformly (docs/design.md §4: warm-starting on the
long-tailed distribution itself memorised the short answers and left RL nothing to
climb); that result is cached under `workdir/models/` by a hash of everything that
shapes it, so only the first run pays for it. Version 0 is committed to the registry
only after its checkpoint is durable.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from sluice.engines.policy import shipped_policy
from sluice.engines.policy.model import build_tiny_policy
from sluice.engines.policy.warm_checks import EpisodeCheck
from sluice.engines.policy.warmstart import warm_start
from sluice.infra.checkpoints import save_checkpoint
from sluice.infra.config import RunConfig
from sluice.tasks.prompts import build_problem, load_policy_tokenizer
from sluice.tasks.run.paths import run_paths, run_registry
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


def initial_policy_dir(config: RunConfig, say: Any = log.info) -> tuple[Path, dict[str, Any]]:
    """The directory of policy version 0 and a few facts about how it was made."""
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
    latest = registry.latest()
    if latest is not None:
        say(f"resuming from committed policy version {latest.policy_version}")
        return {
            "policy_version": latest.policy_version,
            "checkpoint_uri": latest.checkpoint_uri,
            "resumed": True,
        }
    model_dir, facts = initial_policy_dir(config, say)
    uri = save_checkpoint(
        model_dir, run_paths(config, run_id).checkpoint(0), storage_options=config.storage.options
    )
    tags = {k: v for k, v in facts.items() if k != "path"}
    registry.commit(0, uri, run_id=mlflow_run_id, tags=tags, trainer_step=0)
    say(f"policy version 0 committed: {uri} ({facts['source']})")
    return {"policy_version": 0, "checkpoint_uri": uri, "resumed": False, **facts}


@task(name="prepare-policy", retries=1, cache_policy=NO_CACHE, persist_result=False)
def prepare_policy(config: dict[str, Any], run_id: str, mlflow_run_id: str) -> dict[str, Any]:
    """Build/warm-start the initial policy if needed and commit it as version 0."""
    logger = get_run_logger()
    return ensure_version_zero(RunConfig.model_validate(config), run_id, mlflow_run_id, logger.info)
