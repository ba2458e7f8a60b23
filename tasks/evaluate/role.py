"""Held-out evaluation of committed policy versions.

The held-out reward (`eval/reward`) is the mean reward of `evaluation.samples`
samples per held-out prompt at `evaluation.temperature` (default: the rollout
temperature). That is the quantity RL maximises, measured on prompts it never trains
on. Greedy accuracy (`eval/greedy_accuracy`) is logged beside it: it moves more slowly,
because RL first sharpens the sampling distribution towards answers the policy could
already give, and it says whether the policy's single most likely answer improved.
pass@k (`eval/pass_at_{k}`, each k of `evaluation.pass_at_k`) is estimated from the
same samples.
Results go to MLflow (`eval/reward` at step = policy version) and onto the model
version as tags, so the registry shows which version is best.

As a role beside training, it polls the registry and evaluates version 0, every
`evaluation.every`-th version and the final one; it runs at low CPU priority so it takes
what generation and training leave. On demand, `evaluate_version` is the Prefect task
the `evaluate` flow (`sluice eval`) runs for one chosen version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from sluice.engines.env.episodes import Episode, run_on_engine
from sluice.engines.env.verifiers import load_verifier
from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationRequest, SamplingParams
from sluice.engines.policy.model import resolve_device
from sluice.engines.rl.evaluation import heldout_metrics
from sluice.infra.checkpoints import CheckpointIncomplete
from sluice.infra.config.run import RunConfig
from sluice.infra.policy_version import TAG_EVAL_REWARD, CommittedVersion, eval_tag
from sluice.infra.registry import CheckpointRegistry, RegistryError
from sluice.infra.tracking import log_metrics
from sluice.tasks.prompts import PromptSource
from sluice.tasks.role import Role
from sluice.tasks.run.eval_schedule import should_evaluate
from sluice.tasks.run.paths import run_registry
from sluice.tasks.run.versions import fetch_model_uri
from sluice.tasks.tool_runner import ToolBox, episode_spec

log = logging.getLogger("sluice.evaluate")


def eval_seed(seed: int, prompt: int, sample: int) -> int:
    """Sampling seed of held-out sample `sample` of prompt `prompt`: fixed, so every version
    is scored on the same random numbers and two versions differ by their weights, not by
    their luck."""
    return seed * 1_000_003 + prompt * 101 + sample


def eval_requests(
    config: RunConfig,
    prompt_ids: list[list[int]],
    temperature: float,
    with_greedy: bool,
    stop_token_ids: tuple[int, ...] = (),
) -> list[GenerationRequest]:
    """`evaluation.samples` seeded samples per prompt, then a greedy one when asked; every
    response ends at one of `stop_token_ids` (the policy's end tokens) or the token cap."""
    max_new_tokens = config.rollout.max_new_tokens
    requests = []
    for i, ids in enumerate(prompt_ids):
        for j in range(config.evaluation.samples):
            sampling = SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=eval_seed(config.seed, i, j),
                stop_token_ids=stop_token_ids,
            )
            requests.append(GenerationRequest(prompt_token_ids=ids, sampling=sampling))
        if with_greedy:
            sampling = SamplingParams(
                max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop_token_ids
            )
            requests.append(GenerationRequest(prompt_token_ids=ids, sampling=sampling))
    return requests


def evaluate_model_dir(
    config: RunConfig, model_dir: Path, policy_version: int = 0
) -> dict[str, float]:
    """pass@1 of the weights in `model_dir` on the run's held-out prompts."""
    source = PromptSource(config).use_policy(model_dir)
    rows = source.eval_rows()
    verifier = load_verifier(
        config.reward.verifier,
        correct_reward=config.reward.correct_reward,
        incorrect_reward=config.reward.incorrect_reward,
    )
    k = config.evaluation.samples
    temperature = config.evaluation.temperature
    if temperature is None:
        temperature = config.rollout.temperature
    with_greedy = config.evaluation.greedy and temperature > 0
    engine = InferenceEngine(
        model_dir,
        device=resolve_device(config.device),
        dtype=config.rollout.dtype,
        max_batch_size=config.rollout.max_batch_size,
        max_seq_len=config.rollout.max_seq_len,
        seed=config.seed,
        weight_version=policy_version,
    )
    started = time.monotonic()
    requests = eval_requests(
        config,
        [source.encode_prompt(row) for row in rows],
        temperature,
        with_greedy,
        source.stop_token_ids,
    )
    tokenizer = source.tokenizer
    episodes: list[Episode] = []
    try:
        if config.episode.tools:
            episodes = eval_episodes(config, engine, tokenizer, requests)
            responses = [e.response_token_ids for e in episodes]
        else:
            responses = [out.output_token_ids for out in engine.generate(requests)]
    finally:
        engine.shutdown()
    per_prompt = k + int(with_greedy)
    rewards = [
        float(verifier(rows[n // per_prompt], tokenizer.decode(ids, skip_special_tokens=True)))
        for n, ids in enumerate(responses)
    ]
    metrics = heldout_metrics(
        rows,
        rewards,
        [len(ids) for ids in responses],
        samples_per_prompt=k,
        with_greedy=with_greedy,
        correct_reward=config.reward.correct_reward,
        greedy_temperature=temperature == 0,
        pass_at=config.evaluation.pass_at_k,
    )
    if episodes:
        metrics.update(tool_use_metrics(episodes, per_prompt, k))
    metrics["eval/time_s"] = time.monotonic() - started
    return metrics


def eval_episodes(
    config: RunConfig, engine: InferenceEngine, tokenizer: Any, requests: list[GenerationRequest]
) -> list[Episode]:
    """One multi-turn episode per evaluation request, the run's tools answering calls."""
    spec = episode_spec(config, tokenizer)
    toolbox = ToolBox.for_run(config)
    try:
        return run_on_engine(
            engine,
            [list(r.prompt_token_ids) for r in requests],
            spec,
            lambda i: requests[i].sampling,
            toolbox,
            lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
            lambda ids: str(tokenizer.decode(ids)),
        )
    finally:
        toolbox.close()


def tool_use_metrics(episodes: list[Episode], per_prompt: int, k: int) -> dict[str, float]:
    """How the sampled held-out episodes used their tools (greedy ones left out)."""
    sampled = [e for n, e in enumerate(episodes) if n % per_prompt < k]
    calls = sum(e.tool_calls for e in sampled)
    return {
        "eval/calling_fraction": sum(e.tool_calls > 0 for e in sampled) / max(1, len(sampled)),
        "eval/tool_calls_mean": calls / max(1, len(sampled)),
        "eval/tool_error_rate": sum(e.tool_errors for e in sampled) / calls if calls else 0.0,
        "eval/turns_mean": sum(len(e.turns) for e in sampled) / max(1, len(sampled)),
    }


def eval_weights_dir(config: RunConfig, run_id: str) -> Path:
    """Local cache of the checkpoints evaluated for one run (role and on-demand flow share it)."""
    return Path(config.workdir) / "runs" / run_id / "eval-weights"


def evaluate_checkpoint(
    config: RunConfig, run_id: str, policy_version: int, checkpoint_uri: str
) -> dict[str, float]:
    """Fetch one committed checkpoint into the run's evaluation cache and score it.

    The evaluate role, `sluice eval` and the time-to-target benchmark share the cache,
    so weights one of them fetched are not downloaded again.
    """
    local = fetch_model_uri(config, checkpoint_uri, eval_weights_dir(config, run_id), keep_latest=2)
    return evaluate_model_dir(config, local, policy_version)


def choose_target(wanted: list[CommittedVersion], finished: bool) -> CommittedVersion:
    """The version to evaluate next among `wanted` (oldest first, never empty).

    Oldest first for a readable curve, but never fall behind by more than one: with
    several waiting the newest goes next, unless the run has finished and there is time
    for all of them. Version 0 always goes first: it is the start of every held-out
    curve and the baseline the run summary reports, so it is never skipped (a short
    run can commit several versions before the evaluator's first look).
    """
    if len(wanted) == 1 or finished or wanted[0].policy_version == 0:
        return wanted[0]
    return wanted[-1]


def record(
    config: RunConfig,
    registry: CheckpointRegistry,
    mlflow_run_id: str,
    version: CommittedVersion,
    metrics: dict[str, float],
) -> None:
    log_metrics(config.tracking.uri, mlflow_run_id, metrics, step=version.policy_version)
    registry.set_tag(
        version.policy_version, eval_tag("pass_at_1"), f"{metrics['eval/pass_at_1']:.4f}"
    )
    for k in config.evaluation.pass_at_k:
        if k > 1:
            registry.set_tag(
                version.policy_version,
                eval_tag(f"pass_at_{k}"),
                f"{metrics[f'eval/pass_at_{k}']:.4f}",
            )
    registry.set_tag(version.policy_version, TAG_EVAL_REWARD, f"{metrics['eval/reward']:.4f}")


class EvaluateRole(Role):
    """Evaluates version 0, every `evaluation.every`-th version and the final one, as they land."""

    name = "evaluate"

    @property
    def poll_interval_s(self) -> float:
        return self.config.evaluation.poll_interval_s

    def run(self) -> None:
        with contextlib.suppress(OSError):
            os.nice(5)
        cfg, registry, control = self.config, self.registry, self.control
        done: dict[int, dict[str, Any]] = {
            v.policy_version: {"eval/reward": float(v.tags[TAG_EVAL_REWARD])}
            for v in registry.versions()
            if TAG_EVAL_REWARD in v.tags
        }
        history = sorted((v, m["eval/reward"]) for v, m in done.items())
        while True:
            finished = control.done_marker() is not None
            # Never back to a version older than the newest scored (skipped ones stay
            # skipped after a restart too): retention lets those go (tasks/run/retention.py).
            newest = max((v for v, _ in history), default=-1)
            versions = [
                v
                for v in registry.versions()
                if v.policy_version not in done
                and v.policy_version > newest
                and v.durable
                and not v.deleted
            ]
            wanted = [v for v in versions if should_evaluate(v.policy_version, cfg)]
            if finished and not wanted:
                # The run ended: make sure the newest version was evaluated, then leave.
                latest = registry.newest_durable()
                if latest is not None and latest.policy_version not in done:
                    wanted = [latest]
                else:
                    break
            if not wanted:
                self.status.update(state="waiting", last_reward=history[-1][1] if history else None)
                control.sleep(self.poll_interval_s)
                # Only a signal ends the wait early: the done marker means "evaluate the
                # final version, then leave", which the top of the loop handles.
                if control.stop_requested():
                    break
                continue
            target = choose_target(wanted, finished)
            try:
                metrics = evaluate_checkpoint(
                    cfg, self.run_id, target.policy_version, target.checkpoint_uri
                )
            except CheckpointIncomplete as err:
                # Deleted or altered after its commit (a lifecycle rule, a person): the
                # held-out curve goes on without this point; training does not need it.
                log.error("policy version %d not evaluated: %s", target.policy_version, err)
                done[target.policy_version] = {"unreadable": True}
                self.status.update(
                    force=True,
                    versions_unreadable=sum("unreadable" in m for m in done.values()),
                )
                continue
            record(cfg, registry, self.mlflow_run_id, target, metrics)
            done[target.policy_version] = metrics
            history.append((target.policy_version, metrics["eval/reward"]))
            log.info(
                "policy version %d: held-out reward %.3f",
                target.policy_version,
                metrics["eval/reward"],
            )
            self.status.update(
                force=True,
                state="running",
                last_version=target.policy_version,
                last_reward=metrics["eval/reward"],
                history=history,
            )
            # Versions skipped in favour of a newer one are not evaluated later.
            for v in wanted:
                if v.policy_version < target.policy_version:
                    done.setdefault(v.policy_version, {"skipped": True})
        self.status.update(force=True, state="stopped", history=history)


@task(name="evaluate-version", cache_policy=NO_CACHE, persist_result=False)
def evaluate_version(
    config: dict[str, Any], run_id: str, policy_version: int, mlflow_run_id: str
) -> dict[str, float]:
    """pass@1 of committed `policy_version` of `run_id`, logged to `mlflow_run_id` and tagged.

    Plain arguments only: the task may run in another process than the flow that calls it.
    """
    cfg = RunConfig.model_validate(config)
    registry = run_registry(cfg, run_id)
    target = registry.get(policy_version)
    if target is None:
        raise RegistryError(
            f"policy version {policy_version} of run {run_id!r} is not committed in "
            f"{registry.model_name!r} at {cfg.tracking.uri}"
        )
    if target.deleted:
        raise RegistryError(
            f"policy version {policy_version} of run {run_id!r} was deleted by retention "
            "(storage.keep_versions); pin a version with an alias or the tag sluice.keep "
            "before it is let go"
        )
    metrics = evaluate_checkpoint(cfg, run_id, policy_version, target.checkpoint_uri)
    record(cfg, registry, mlflow_run_id, target, metrics)
    get_run_logger().info(
        "run %s policy version %d: held-out reward %.3f, pass@1 %.3f",
        run_id,
        policy_version,
        metrics["eval/reward"],
        metrics["eval/pass_at_1"],
    )
    return metrics
