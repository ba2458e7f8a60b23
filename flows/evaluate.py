"""The `evaluate` flow: held-out pass@1 of one committed policy version, on demand.

    sluice eval --run RUN [--version N]

Training evaluates as it goes (the evaluate role); this flow answers the question later,
for any version of any run: look the version up in the run's registry (newest = the
alias), run the `evaluate-version` task on it, and leave the result where people look.

- MLflow: `eval/*` at step = policy version, in the MLflow run that produced the version
  (its id travels on the model version), so an on-demand evaluation lands on the same
  curve as the ones made during training. A version registered without a run gets a new
  MLflow run in the config's experiment, named `{run}-eval-v{version}`.
- Registry: `sluice.eval.reward` and `sluice.eval.pass_at_1` tags on the model version.
- Prefect: a table artifact (`policy-evaluation`) and a markdown summary on the flow run.

Evaluating a version again logs a second point at the same step and overwrites its
tags with the newest result: the samples are seeded, so with the same config the numbers
repeat, and a changed `evaluation.samples` should win.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from sluice.flows.run_claim import flow_run_name
from sluice.flows.run_secrets import take_secrets
from sluice.infra.config.run import RunConfig, load_config
from sluice.infra.config.tracking import ui_command
from sluice.infra.registry import CommittedVersion
from sluice.infra.secrets import redact_uri
from sluice.infra.tracking import (
    end_run,
    get_client,
    log_config,
    start_or_resume_run,
)
from sluice.tasks.run.paths import registered_model_name, run_registry

TABLE_ARTIFACT_KEY = "policy-evaluation"
SUMMARY_ARTIFACT_KEY = "policy-evaluation-summary"


class VersionNotFound(LookupError):
    """The run has no such committed policy version (or none at all); says which exist."""


def _describe_versions(policy_versions: list[int]) -> str:
    if not policy_versions:
        return "none"
    first, last = policy_versions[0], policy_versions[-1]
    if len(policy_versions) > 2 and policy_versions == list(range(first, last + 1)):
        return f"{first}-{last}"
    shown = ", ".join(map(str, policy_versions[-10:]))
    return f"..., {shown}" if len(policy_versions) > 10 else shown


def find_version(config: RunConfig, run_id: str, version: int | None) -> CommittedVersion:
    """The committed policy version `version` of `run_id` (None = where the alias points).

    Read-only: a run that never registered a model is reported, not given an empty one
    (constructing a CheckpointRegistry would register the model name as a side effect).
    Raises VersionNotFound with one line naming the run and the versions it has.
    """
    name = registered_model_name(config, run_id)
    client = get_client(config.tracking.uri)
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        raise VersionNotFound(
            f"run '{run_id}' has no committed policy versions "
            f"(no registered model '{name}' at {redact_uri(config.tracking.uri)})"
        )
    registry = run_registry(config, run_id)
    if version is None:
        latest = registry.newest_durable()
        if latest is None:
            raise VersionNotFound(f"run '{run_id}' has no committed policy versions yet")
        return latest
    found = registry.get(version) if version >= 0 else None
    if found is None:
        committed = [v.policy_version for v in registry.versions() if not v.lost]
        raise VersionNotFound(
            f"run '{run_id}' has no policy version {version} "
            f"(committed: {_describe_versions(committed)})"
        )
    if not found.durable:
        durable = registry.newest_durable()
        raise VersionNotFound(
            f"policy version {version} of run '{run_id}' is {found.durability}, not durable: "
            "its weights are not committed to storage"
            + (f" (the newest durable one is {durable.policy_version})" if durable else "")
        )
    return found


def _tracking_run_for(config: RunConfig, run_id: str, target: CommittedVersion) -> tuple[str, bool]:
    """(MLflow run id to log into, whether this flow created it and must end it)."""
    if target.run_id:
        return target.run_id, False
    mlflow_run_id = start_or_resume_run(
        config.tracking.uri,
        config.tracking.experiment,
        run_name=f"{run_id}-eval-v{target.policy_version}",
        artifact_location=config.tracking.artifact_location,
        tags={
            "sluice.run_id": run_id,
            "sluice.policy_version": target.policy_version,
            "sluice.kind": "evaluation",
        },
    )
    log_config(config.tracking.uri, mlflow_run_id, config)
    return mlflow_run_id, True


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The result as one table row (Prefect table artifact)."""
    return [
        {
            "run_id": result["run_id"],
            "policy_version": result["policy_version"],
            "model_version": result["model_version"],
            "held_out_reward": round(result["eval/reward"], 4),
            "pass_at_1": round(result["eval/pass_at_1"], 4),
            "prompts": int(result["eval/prompts"]),
            "samples_per_prompt": result["samples_per_prompt"],
            "response_length_mean_tokens": round(result["eval/response_length_mean"], 2),
            "eval_time_s": round(result["eval/time_s"], 2),
            "checkpoint_uri": result["checkpoint_uri"],
        }
    ]


def summary_markdown(result: dict[str, Any], tracking_uri: str) -> str:
    return "\n".join(
        [
            f"# Held-out evaluation of `{result['run_id']}` policy version "
            f"{result['policy_version']}",
            "",
            f"- held-out reward: **{result['eval/reward']:.4f}**, "
            f"pass@1: **{result['eval/pass_at_1']:.4f}**",
            f"- {int(result['eval/prompts'])} prompts × {result['samples_per_prompt']} "
            f"samples each, mean response {result['eval/response_length_mean']:.1f} tokens, "
            f"{result['eval/time_s']:.1f} s",
            f"- model version {result['model_version']} of `{result['registered_model']}` "
            "(tagged `sluice.eval.reward`, `sluice.eval.pass_at_1`)",
            f"- checkpoint: `{result['checkpoint_uri']}`",
            f"- MLflow run `{result['mlflow_run_id']}` (`{ui_command(tracking_uri)}`)",
        ]
    )


@flow(name="sluice-evaluate", flow_run_name=flow_run_name, log_prints=True)
def evaluate(
    config: RunConfig | None = None, *, run_id: str, version: int | None = None
) -> dict[str, Any]:
    """pass@1 of one committed policy version of run `run_id` on its held-out prompts.

    `config` should be the run's own (its storage and MLflow settings locate the
    checkpoints and the registry); None means flows/configs/default.yaml. `version` None
    evaluates the newest committed version.
    """
    # sluice.tasks.evaluate.role imports torch: importing it here lets `sluice eval` reject a missing
    # version (flows/cli.py) in about a second.
    from sluice.tasks.evaluate.role import evaluate_version

    config = take_secrets(config or load_config("default"), run_id)  # flows/run_secrets.py
    logger = get_run_logger()
    target = find_version(config, run_id, version)
    mlflow_run_id, created = _tracking_run_for(config, run_id, target)
    logger.info(
        "evaluating run %s policy version %d (%s) into MLflow run %s",
        run_id,
        target.policy_version,
        target.checkpoint_uri,
        mlflow_run_id,
    )
    try:
        metrics = evaluate_version(
            config.model_dump(mode="json"), run_id, target.policy_version, mlflow_run_id
        )
    except BaseException:
        if created:
            end_run(config.tracking.uri, mlflow_run_id, status="FAILED")
        raise
    if created:
        end_run(config.tracking.uri, mlflow_run_id)
    result: dict[str, Any] = {
        "run_id": run_id,
        "policy_version": target.policy_version,
        "model_version": target.model_version,
        "registered_model": registered_model_name(config, run_id),
        "checkpoint_uri": target.checkpoint_uri,
        "mlflow_run_id": mlflow_run_id,
        "samples_per_prompt": config.evaluation.samples,
        **metrics,
    }
    create_table_artifact(
        summary_rows(result),
        key=TABLE_ARTIFACT_KEY,
        description=f"Held-out evaluation of {run_id} policy version {target.policy_version}",
    )
    create_markdown_artifact(
        summary_markdown(result, config.tracking.uri),
        key=SUMMARY_ARTIFACT_KEY,
        description=f"Held-out evaluation of {run_id}",
    )
    return result
