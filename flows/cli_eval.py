"""`sluice eval`: score a committed policy version of a run on held-out prompts
(flows/evaluate.py) and print the result as a short table."""

from __future__ import annotations

from typing import Any

from sluice.flows.cli_common import fail
from sluice.infra.config.run import RunConfig


def run_eval(config: RunConfig, run_id: str, version: int | None = None) -> int:
    """Exit 2 with one line when the version does not exist, else evaluate it."""
    from sluice.flows.evaluate import VersionNotFound, evaluate, find_version
    from sluice.infra.registry import RegistryError
    from sluice.infra.tracking import TrackingError

    try:
        find_version(config, run_id, version)
    except VersionNotFound as err:
        return fail(err)
    except (TrackingError, RegistryError) as err:
        return fail(err, code=1)
    from sluice.flows.run_secrets import hand_over

    # The flow's parameters are stored by Prefect: credentials travel in a 0600 file.
    result = evaluate(hand_over(config, run_id), run_id=run_id, version=version)
    print(format_eval_result(result))
    return 0


def format_eval_result(result: dict[str, Any]) -> str:
    """A short two-column table for the terminal."""
    rows = [
        ("run", result["run_id"]),
        ("policy version", str(result["policy_version"])),
        ("model version", f"{result['model_version']} of {result['registered_model']}"),
        ("held-out reward", f"{result['eval/reward']:.4f}"),
        ("pass@1", f"{result['eval/pass_at_1']:.4f}"),
        *(
            (f"pass@{key.removeprefix('eval/pass_at_')}", f"{value:.4f}")
            for key, value in result.items()
            if key.startswith("eval/pass_at_") and key != "eval/pass_at_1"
        ),
        (
            "prompts x samples",
            f"{int(result['eval/prompts'])} x {result['samples_per_prompt']}",
        ),
        ("response length", f"{result['eval/response_length_mean']:.1f} tokens (mean)"),
        ("time", f"{result['eval/time_s']:.1f} s"),
        ("MLflow run", result["mlflow_run_id"]),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
