"""`sluice serve`: the flows as Prefect deployments, served from this process.

Two routes to the same three deployments (names match prefect.yaml):

- prefect.yaml + a process work pool (`prefect deploy --all`, `prefect worker start`):
  the deployments live on the server and any worker that can reach this checkout
  runs them;
- `sluice serve` (flows/cli.py): `prefect.serve(...)` over the deployments that
  `build_deployments` here makes with `flow.to_deployment(...)`, Prefect's long-running
  serve mode. No work pool or worker: this process polls the API and runs each flow
  run in a subprocess. The CLI's resolved config becomes the default
  `config` parameter of `train` and `train-sync`, so `sluice serve my.yaml --set ...`
  serves exactly what `sluice train my.yaml --set ...` would run; it can still be
  edited per run in the UI or with `prefect deployment run ... --param`. Its
  credentials are redacted there; the served runs read them from a 0600 file
  (flows/run_secrets.py).

The nightly reproduction keeps its own pinned config (flows/configs/reproduce.yaml);
only the keys that say *where* a run lives (workdir, storage, tracking) follow the
served config, so a served stack on S3 and a remote MLflow reproduces into them too.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, cast

from sluice.infra.config.run import RunConfig
from sluice.infra.secrets import redact_config

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

REPRODUCE_CONFIG = "reproduce"
REPRODUCE_CRON = "0 3 * * *"
REPRODUCE_TIMEZONE = "UTC"

# Keys that place a run (paths, servers), not ones that shape its result.
PLACEMENT_KEYS = (
    "workdir",
    "storage.url",
    "storage.options",
    "tracking.uri",
    "tracking.artifact_location",
    "tracking.experiment",
)


def placement_overrides(config: RunConfig) -> list[str]:
    """`key=value` overrides for the placement keys where `config` differs from the defaults."""
    defaults = RunConfig()
    overrides = []
    for key in PLACEMENT_KEYS:
        ours, default = config, defaults
        for part in key.split("."):
            ours, default = getattr(ours, part), getattr(default, part)
        if ours != default:
            # JSON is valid YAML, which is how `--set` values are parsed back.
            overrides.append(f"{key}={json.dumps(ours)}")
    return overrides


def build_deployments(config: RunConfig) -> list[RunnerDeployment]:
    """The train, train-sync and reproduce-nightly deployments; nothing is sent to an API."""
    from prefect.deployments.runner import EntrypointType
    from prefect.schedules import Cron

    from sluice.flows.reproduce import reproduce
    from sluice.flows.train import train
    from sluice.flows.train_sync import train_sync

    # Deployment parameters live on the Prefect server and show in its UI: credentials
    # are redacted, and the served flow runs read them from `sluice serve`'s 0600 file
    # (flows/run_secrets.py).
    config = RunConfig.model_validate(redact_config(config.model_dump(mode="json")))
    resolved = config.model_dump(mode="json")
    # Module entrypoints (sluice.flows.train.train) load from the installed package, so the
    # served runs work from any working directory, inside a container included.
    common: dict[str, Any] = {"entrypoint_type": EntrypointType.MODULE_PATH}
    reproduce_parameters: dict[str, Any] = {"config_name": REPRODUCE_CONFIG}
    if overrides := placement_overrides(config):
        reproduce_parameters["overrides"] = overrides
    deployments = [
        train.to_deployment(
            name="train",
            description="Asynchronous RL run on the config `sluice serve` was given.",
            parameters={"config": resolved},
            tags=["sluice"],
            **common,
        ),
        train_sync.to_deployment(
            name="train-sync",
            description="Synchronous colocated baseline on the same config.",
            parameters={"config": resolved},
            tags=["sluice", "baseline"],
            **common,
        ),
        reproduce.to_deployment(
            name="reproduce-nightly",
            description="Re-run the pinned reproduction config and fail loudly outside the reference band.",
            parameters=reproduce_parameters,
            schedules=[Cron(REPRODUCE_CRON, timezone=REPRODUCE_TIMEZONE)],
            tags=["sluice", "reproduction"],
            **common,
        ),
    ]
    # to_deployment is typed to return a coroutine too, which it does only when called
    # from async code; this function is sync.
    return cast("list[RunnerDeployment]", deployments)


def next_steps(deployments: list[RunnerDeployment], api_url: str | None, ui_url: str | None) -> str:
    """What to type once the deployments are being served."""
    lines = ["Serving Sluice deployments (Ctrl-C stops serving and pauses their schedules):"]
    for deployment in deployments:
        when = " (nightly 03:00 UTC)" if deployment.schedules else ""
        lines.append(f"  {deployment.flow_name}/{deployment.name}{when}")
    lines += [
        "",
        "Start a run from another shell (same PREFECT_API_URL):",
        "  prefect deployment run sluice-train/train",
        "  prefect deployment run sluice-reproduce/reproduce-nightly   # the nightly check, now",
    ]
    if api_url:
        lines.append(f"Prefect UI:  {ui_url or api_url.removesuffix('/api')}/deployments")
    else:
        lines += [
            "PREFECT_API_URL is not set: Prefect serves from a temporary API that stops with",
            "this process and has no UI. For the UI, run `prefect server start` (UI at",
            "http://127.0.0.1:4200), `export PREFECT_API_URL=http://127.0.0.1:4200/api`,",
            "and serve again.",
        ]
    return "\n".join(lines)
