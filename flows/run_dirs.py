"""Find an earlier run's directory and its saved config (`sluice eval`, `--resume`, `sluice plan`),
and point that config at where a run under one workdir keeps its stores."""

from __future__ import annotations

from pathlib import Path

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import RunConfig, load_config


def resolve_run(
    config: RunConfig, run: str | None, overrides: list[str], purpose: str = "evaluate"
) -> tuple[str, RunConfig]:
    """An earlier run (for `sluice eval` or `--resume`) and its own config, `--set` on top.

    `sluice train` saves each run's resolved config as {workdir}/runs/{run}/config.json.
    Evaluating with it, not with CONFIG, keeps storage and MLflow pointing where the run
    wrote its checkpoints and registry; CONFIG and --set only have to locate the workdir.
    No `run` means the run whose config was written last (a resume rewrites it).
    Raises ConfigError with one line naming the run (and, where there is none, what it
    was wanted for: `purpose`).
    """
    runs_dir = Path(config.workdir) / "runs"
    saved = sorted(
        runs_dir.glob("*/config.json"), key=lambda path: (path.stat().st_mtime, path.parent.name)
    )
    if run is None:
        if not saved:
            raise ConfigError(
                f"no runs to {purpose} under {runs_dir} (none has a config.json); "
                "train one with 'sluice train' or point --set workdir=... at its workdir"
            )
        path = saved[-1]
    else:
        path = runs_dir / run / "config.json"
        # A run id is one directory name: anything else would resolve outside runs_dir.
        if Path(run).name != run or run.startswith(".") or not path.is_file():
            names = sorted(p.parent.name for p in saved)
            known = f"; runs there: {', '.join(names[-5:])}" if names else ""
            raise ConfigError(f"run '{run}' not found: no {path}{known}")
    return path.parent.name, load_config(path, overrides)


def absolute_store_settings(workdir: Path) -> list[str]:
    """`--set` settings that point a run's saved config at the stores a default run
    keeps under `workdir` (`.sluice/`), by absolute paths.

    The saved config's relative `sqlite:///.sluice/mlflow.db` would do after a chdir,
    but MLflow caches its store by URI within a process: a second run's reading would
    find the first run's (perhaps deleted) database."""
    root = workdir / ".sluice"
    return [
        f"workdir={root}",
        f"storage.url=file://{root}/runs",
        f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"tracking.artifact_location={root}/mlartifacts",
    ]
