"""Entry point of a role process: `python -m sluice.tasks.process.worker ROLE --config FILE --run-id RUN`.

The config arrives as the resolved JSON the flow wrote, so every role of a run sees
exactly the same settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sluice.infra.config import RunConfig
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
    config = RunConfig.model_validate(json.loads(Path(args.config).read_text()))
    limit_threads(role_threads(config, args.role))
    if args.role == "rollout":
        # The server's start-up (its own imports and the model) runs while this process
        # imports the rollout loop's dependencies.
        from sluice.tasks.process.inference_server import start_early

        server = start_early(config, args.run_id)
        from sluice.tasks.rollout import RolloutRole

        RolloutRole.main(config, args.run_id, args.mlflow_run_id, server=server)
        return 0
    if args.role == "reward":
        from sluice.tasks.reward import RewardRole as role
    elif args.role == "train":
        from sluice.tasks.train import TrainRole as role
    elif args.role == "sync":
        from sluice.tasks.sync import SyncRole as role
    else:
        from sluice.tasks.evaluate import EvaluateRole as role
    role.main(config, args.run_id, args.mlflow_run_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
