"""How a run's credentials reach its flow without passing through Prefect.

A flow's parameters are stored by the Prefect API and shown in its UI (and a
deployment's default parameters with them), so the config a flow is called with has
its secrets redacted (infra/secrets.py). The real values go into a file readable by
this user only (0600) beside the run, which the flow reads by path as it starts:

- `sluice train` writes ``{workdir}/runs/{run id}/secrets.json`` before it calls the
  flow in its own process;
- `sluice serve` writes ``{workdir}/secrets.json`` for the flow runs it serves (which
  start in its subprocesses, on the same machine and workdir).

A file rather than the CLI's environment: every process the run starts inherits an
environment, and a same-user process (model code in the process sandbox included) can
read another's ``/proc/<pid>/environ``. Credentials given in the environment itself
(``AWS_*``, ``MLFLOW_TRACKING_PASSWORD``) never enter the config and need none of this
(docs/operations.md, "Giving credentials").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import RunConfig
from sluice.infra.secrets import (
    SECRETS_FILE,
    has_redactions,
    redact_config,
    restore_secrets,
    write_private_json,
)


def run_secrets_path(config: RunConfig, run_id: str | None) -> Path:
    """Where the flow of run `run_id` finds its secrets (the served flows' file for None)."""
    workdir = Path(config.workdir)
    return workdir / "runs" / run_id / SECRETS_FILE if run_id else workdir / SECRETS_FILE


def hand_over(config: RunConfig, run_id: str | None) -> RunConfig:
    """The config to pass as a flow parameter: `config` with its secrets redacted, the
    real values written (0600) where the flow of `run_id` reads them."""
    real = config.model_dump(mode="json")
    shown = redact_config(real)
    if shown == real:
        return config
    write_private_json(run_secrets_path(config, run_id), real)
    return RunConfig.model_validate(shown)


def shown_parameters(config: RunConfig) -> dict[str, Any]:
    """`config` as a flow or deployment parameter: a dict, secrets redacted."""
    return redact_config(config.model_dump(mode="json"))


def take_secrets(config: RunConfig, run_id: str) -> RunConfig:
    """`config` (a flow's parameter) with its redacted values restored from the run's
    secrets file, else the served flows' one; unchanged when nothing was redacted."""
    shown = config.model_dump(mode="json")
    if not has_redactions(shown):
        return config
    for path in (run_secrets_path(config, run_id), run_secrets_path(config, None)):
        try:
            real = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the run's credentials from {path}: {exc}") from None
        restored = restore_secrets(shown, real)
        if has_redactions(restored):
            raise ConfigError(
                f"{path} does not hold every credential run {run_id}'s config left out; "
                "start the run again with `sluice train`"
            )
        return RunConfig.model_validate(restored)
    raise ConfigError(
        f"run {run_id}'s config has redacted credentials and no file holds them "
        f"({run_secrets_path(config, run_id)}); start it with `sluice train`/`sluice serve`, "
        "or give credentials in the environment (docs/operations.md)"
    )
