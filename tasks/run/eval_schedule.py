"""Which policy versions the evaluation schedule scores: version 0, every
`evaluation.every`-th version and the final one.

Its own light module because two rooms read it: the evaluate role (tasks/evaluate/role.py),
which scores those versions, and retention (tasks/run/retention.py), which keeps their
checkpoints until they are scored. Importing it loads no inference engine and no Prefect.
"""

from __future__ import annotations

from sluice.infra.config.run import RunConfig


def should_evaluate(version: int, config: RunConfig) -> bool:
    every = config.evaluation.every
    return (
        version == 0
        or version >= config.trainer.total_steps
        or (every > 0 and version % every == 0)
    )
