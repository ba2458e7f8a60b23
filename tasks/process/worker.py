"""Entry point of a role process: `python -P -m sluice.tasks.process.worker ROLE --config FILE
--run-id RUN`.

The config arrives as the resolved JSON the flow wrote, so every role of a run sees
exactly the same settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sluice.infra.config.run import RunConfig
from sluice.tasks.process.launcher import working_directory_last
from sluice.tasks.run.logs import configure_logging
from sluice.tasks.run.paths import ROLES
from sluice.tasks.run.threads import limit_threads, role_threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.tasks.process.worker")
    parser.add_argument("role", choices=(*ROLES, "sync"))
    parser.add_argument("--config", required=True, help="resolved run config (JSON)")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--mlflow-run-id", required=True)
    args = parser.parse_args(argv)
    configure_logging(args.role)
    working_directory_last()  # a fresh interpreter (-P); a forked role has it already
    try:
        config = RunConfig.model_validate(json.loads(Path(args.config).read_text()))
        limit_threads(role_threads(config, args.role))
        options: dict[str, Any] = {}
        if args.role == "rollout":
            # The server's start-up (its own imports and the model) runs while this
            # process imports the rollout loop's dependencies.
            from sluice.tasks.process.inference_server import start_early

            options["server"] = start_early(config, args.run_id)
        role = role_class(args.role)
    except Exception as exc:
        from sluice.tasks.role import cannot_start

        cannot_start(args.role, exc)
    role.main(config, args.run_id, args.mlflow_run_id, **options)
    return 0


def role_class(role: str) -> Any:
    """The `Role` subclass of `role`, imported only in the process that runs it."""
    if role == "rollout":
        from sluice.tasks.rollout.role import RolloutRole

        return RolloutRole
    if role == "reward":
        from sluice.tasks.reward.role import RewardRole

        return RewardRole
    if role == "train":
        from sluice.tasks.train.role import TrainRole

        return TrainRole
    if role == "sync":
        from sluice.tasks.train.sync import SyncRole

        return SyncRole
    from sluice.tasks.evaluate.role import EvaluateRole

    return EvaluateRole


if __name__ == "__main__":
    sys.exit(main())
