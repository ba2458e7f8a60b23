"""Thin MLflow helpers: runs, config, metrics and artifacts, usable from any process.

Every function takes an explicit run id and talks to MLflow through a per-process cached
``MlflowClient``; nothing relies on mlflow's global "active run", so the rollout, reward
and train processes of one Sluice run can all log into the same MLflow run by passing its
id around (it is a small string, like every other thing that crosses a process boundary).

Every function takes the tracking URI as its first argument, like ``CheckpointRegistry``:
no environment variable or process-global state decides where metrics go, so nothing can
silently land in a stray ``./mlruns`` of some working directory.

Unreachable tracking servers fail fast with one ``TrackingUnavailable`` naming the URI
(an HTTP server gets a short health probe before mlflow's own multi-minute retry loop can
start). Local sqlite databases get their parent directory created.

MLflow's UI as a trainer expects it: experiments are tagged ``mlflow.experimentKind =
custom_model_development`` (the UI's "Machine learning" kind), and printed links open the
machine-learning view (``?workflowType=machine_learning``: MLflow 3.17's UI picks its view
from that or its remembered sidebar switch, else GenAI, where runs show as "evaluation
runs"). ``ui_command`` (infra/config/tracking.py) starts the UI's web server alone, without MLflow 3's job runners.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, ViewType
from mlflow.exceptions import MlflowException
from pydantic import BaseModel

from sluice.infra.secrets import redact_config, redact_text, redact_uri, without_userinfo

logger = logging.getLogger(__name__)

# MLflow's own limits (mlflow.utils.validation): params per log_batch call, metrics per
# call, and the longest param value it stores.
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_MAX_PARAM_VALUE_CHARS = 6000
# Statuses a restarted flow picks up again; a FINISHED run is never reopened by name.
_RESUMABLE_STATUSES = ("RUNNING", "SCHEDULED", "FAILED", "KILLED")
# Where `mlflow ui` listens unless told otherwise.
_LOCAL_UI = "http://127.0.0.1:5000"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""The experiment tag MLflow's UI reads and writes for an experiment's kind."""
EXPERIMENT_KIND = "custom_model_development"
"""MLflow's "Machine learning" kind: runs are training runs, not GenAI evaluation runs."""
# Kinds MLflow's UI shows in its machine-learning view: one a person chose is kept.
_TRAINING_KINDS: tuple[str, ...] = (EXPERIMENT_KIND, "finetuning", "forecasting")
_TRAINING_KINDS += ("classification", "regression", "automl", f"{EXPERIMENT_KIND}_inferred")
_UI_VIEW = "workflowType=machine_learning"

_clients: dict[str, MlflowClient] = {}
_clients_lock = threading.Lock()


class TrackingError(Exception):
    """An MLflow operation failed; the message names the tracking URI (and run, if any)."""


class TrackingUnavailable(TrackingError, ConnectionError):
    """The MLflow tracking server or database at the named URI cannot be reached."""


# ---------------------------------------------------------------- client


def _probe_http(tracking_uri: str, timeout_s: float) -> None:
    # No userinfo: urllib would ask the resolver for `user:password@host` as a host name.
    url = without_userinfo(tracking_uri).rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            pass
    except urllib.error.HTTPError:
        pass  # the server answered: reachable, even if it has no /health route
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TrackingUnavailable(
            f"MLflow tracking server {redact_uri(tracking_uri)} is unreachable: {reason}"
        ) from None


def _prepare_sqlite(tracking_uri: str) -> None:
    # sqlite:///relative.db and sqlite:////absolute.db; the parent must exist before
    # SQLAlchemy opens the file, and a fresh `.sluice/` should not be an error.
    path = tracking_uri[len("sqlite:///") :]
    if not path or path == ":memory:":
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrackingUnavailable(
            f"MLflow tracking database {redact_uri(tracking_uri)} cannot be created: {exc}"
        ) from None
    _use_wal(Path(path))


def _use_wal(path: Path) -> None:
    """Put the sqlite database in write-ahead-log mode (a property of the file, set once).

    Every role process reads the registry (the rollout polls the alias) while the
    trainer writes versions and metrics. In sqlite's default rollback-journal mode a
    writer must wait until no reader holds the file, so each commit queues behind
    the pollers; in WAL mode readers and the one writer proceed side by side.
    """
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(path, timeout=30)) as db:
            if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                db.execute("PRAGMA journal_mode=WAL")
    except sqlite3.Error as exc:  # a read-only or network location: keep the default
        logger.warning("could not switch %s to WAL mode: %s", path, exc)


def get_client(tracking_uri: str, *, connect_timeout_s: float = 5.0) -> MlflowClient:
    """The cached MlflowClient for `tracking_uri` (tracking and registry on the same URI).

    The first call per URI and process checks that the backend answers (opening a sqlite
    database also creates or migrates its tables, which takes seconds once); later calls
    return the same client at no cost. Raises TrackingUnavailable naming the URI.
    """
    if not isinstance(tracking_uri, str) or not tracking_uri.strip():
        raise ValueError(f"MLflow tracking URI must be a non-empty string, got {tracking_uri!r}")
    with _clients_lock:
        cached = _clients.get(tracking_uri)
        if cached is not None:
            return cached
        # Sluice runs offline by design; mlflow's usage telemetry would only add network
        # attempts. An explicit user setting wins.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        if tracking_uri.startswith(("http://", "https://")):
            _probe_http(tracking_uri, connect_timeout_s)
        elif tracking_uri.startswith("sqlite:///"):
            _prepare_sqlite(tracking_uri)
        try:
            client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
            # Touch the backend once, so a broken database fails here and not mid-run.
            client.search_experiments(max_results=1)
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingUnavailable(
                f"MLflow tracking backend {redact_uri(tracking_uri)} is unusable: {redact_text(str(exc))}"
            ) from exc
        _clients[tracking_uri] = client
        return client


@contextlib.contextmanager
def _mlflow_errors(tracking_uri: str, what: str) -> Iterator[None]:
    try:
        yield
    except MlflowException as exc:
        raise TrackingError(
            f"{what} failed at {redact_uri(tracking_uri)}: {redact_text(exc.message)}"
        ) from exc


def _client_for(tracking_uri: str, run_id: str) -> MlflowClient:
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    return get_client(tracking_uri)


# ---------------------------------------------------------------- runs


def _mark_training(client: MlflowClient, experiment_id: str, tags: Mapping[str, str]) -> None:
    """Tag an experiment as model training, unless it already carries such a kind (an
    experiment created before, or marked GenAI, gets the tag when Sluice next uses it)."""
    if tags.get(EXPERIMENT_KIND_TAG) not in _TRAINING_KINDS:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)


def _get_or_create_experiment(
    client: MlflowClient, tracking_uri: str, experiment: str, artifact_location: str | None
) -> str:
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            raise TrackingError(
                f"MLflow experiment {experiment!r} at {redact_uri(tracking_uri)} is deleted; restore it "
                "or choose another experiment name"
            )
        _mark_training(client, str(found.experiment_id), found.tags)
        return str(found.experiment_id)
    location = artifact_location
    if location and "://" not in location:
        # Relative artifact roots would resolve against each process's working directory.
        location = Path(location).resolve().as_uri()
    try:
        return str(
            client.create_experiment(
                experiment,
                artifact_location=location,
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        )
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        # Another process of the same flow created it first.
        raced = client.get_experiment_by_name(experiment)
        if raced is None:
            raise
        _mark_training(client, str(raced.experiment_id), raced.tags)
        return str(raced.experiment_id)


def start_or_resume_run(
    tracking_uri: str,
    experiment: str,
    run_name: str,
    run_id: str | None = None,
    *,
    artifact_location: str | None = None,
    tags: Mapping[str, Any] | None = None,
) -> str:
    """Return the id of a RUNNING MLflow run, resuming an earlier one where possible.

    With `run_id`: that run is reopened (TrackingError if it does not exist). Without it:
    the newest unfinished (RUNNING, FAILED, KILLED) run named `run_name` in `experiment`
    is reopened, so a flow restarted after a crash keeps logging into the same run;
    otherwise a new run is created (and the experiment, with `artifact_location`, if
    needed). The experiment is tagged as model training (module notes). Call this once
    per Sluice run, in the flow, and hand the id to the tasks: two processes racing here
    with no run id could each create a run.
    """
    if not experiment:
        raise ValueError("MLflow experiment name must be non-empty")
    if not run_name or "'" in run_name or '"' in run_name:
        raise ValueError(f"MLflow run name must be non-empty and without quotes, got {run_name!r}")
    client = get_client(tracking_uri)
    with _mlflow_errors(tracking_uri, f"starting MLflow run {run_name!r}"):
        if run_id is not None:
            try:
                run = client.get_run(run_id)
            except MlflowException as exc:
                raise TrackingError(
                    f"MLflow run {run_id!r} not found at {redact_uri(tracking_uri)}: {exc.message}"
                ) from exc
            held_in = client.get_experiment(run.info.experiment_id)
            _mark_training(client, str(held_in.experiment_id), held_in.tags)
        else:
            experiment_id = _get_or_create_experiment(
                client, tracking_uri, experiment, artifact_location
            )
            previous = client.search_runs(
                [experiment_id],
                filter_string=f"attributes.run_name = '{run_name}'",
                run_view_type=ViewType.ACTIVE_ONLY,
                order_by=["attributes.start_time DESC"],
                max_results=20,
            )
            resumable = [r for r in previous if r.info.status in _RESUMABLE_STATUSES]
            if not resumable:
                created = client.create_run(
                    experiment_id,
                    run_name=run_name,
                    tags={str(k): str(v) for k, v in (tags or {}).items()},
                )
                return str(created.info.run_id)
            run = resumable[0]
        resumed_id = str(run.info.run_id)
        if run.info.status != "RUNNING":
            client.update_run(resumed_id, status="RUNNING")
        resumes = int(run.data.tags.get("sluice.resume_count", "0")) + 1
        client.set_tag(resumed_id, "sluice.resume_count", str(resumes))
        for key, value in (tags or {}).items():
            client.set_tag(resumed_id, str(key), str(value))
    return resumed_id


def get_run_experiment_id(tracking_uri: str, run_id: str) -> str:
    """The id of the experiment that holds `run_id` (TrackingError if the run is unknown)."""
    client = _client_for(tracking_uri, run_id)
    with _mlflow_errors(tracking_uri, f"reading MLflow run {run_id!r}"):
        return str(client.get_run(run_id).info.experiment_id)


def run_ui_url(tracking_uri: str, run_id: str) -> str:
    """The MLflow UI page of `run_id`, under the experiment that actually holds it, in
    the UI's machine-learning view (module notes).

    An HTTP tracking server serves its own UI; for a local store (sqlite, files) the base
    is where `ui_command` (infra/config/tracking.py) listens.
    """
    shown = redact_uri(tracking_uri)  # a link people click and copy: no password in it
    base = shown if shown.startswith(("http://", "https://")) else _LOCAL_UI
    experiment_id = get_run_experiment_id(tracking_uri, run_id)
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{_UI_VIEW}"


def end_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    """Mark the run FINISHED, FAILED or KILLED."""
    if status not in ("FINISHED", "FAILED", "KILLED"):
        raise ValueError(f"run status must be FINISHED, FAILED or KILLED, got {status!r}")
    client = _client_for(tracking_uri, run_id)
    with _mlflow_errors(tracking_uri, f"ending MLflow run {run_id!r}"):
        client.set_terminated(run_id, status=status)


# ---------------------------------------------------------------- config


def flatten_config(config: Mapping[str, Any] | BaseModel, prefix: str = "") -> dict[str, str]:
    """Nested mapping (or pydantic model) -> {'dotted.key': 'value'} with string values.

    Lists are JSON-encoded; values longer than MLflow's param limit are cut and marked,
    the full value lives in the config artifact.
    """
    data = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    if not isinstance(data, Mapping):
        raise ValueError(f"config must be a mapping or a pydantic model, got {type(config)}")
    flat: dict[str, str] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, dotted + "."))
            continue
        text = json.dumps(value) if isinstance(value, list | tuple | Mapping) else str(value)
        if len(text) > _MAX_PARAM_VALUE_CHARS:
            text = text[: _MAX_PARAM_VALUE_CHARS - 14] + "...[truncated]"
        flat[dotted] = text
    return flat


def log_config(
    tracking_uri: str,
    run_id: str,
    config: Mapping[str, Any] | BaseModel,
    *,
    artifact_dir: str = "config",
) -> list[str]:
    """Log a resolved config as flattened params plus a YAML artifact; return changed keys.

    MLflow params are immutable, so on a resumed run a key whose value changed is NOT
    re-logged (a warning names it, and the returned list holds it); the new resolved
    config is then stored next to the first as ``resolved_config-<UTC time>.yaml``, so
    both configs stay readable in the run.
    """
    import yaml

    client = _client_for(tracking_uri, run_id)
    if isinstance(config, BaseModel):
        data = config.model_dump(mode="json")
    else:
        # Paths, enums and the like become strings, so the YAML artifact always serialises.
        data = json.loads(json.dumps(dict(config), default=str))
    data = redact_config(data)  # credentials never become params or artifacts
    flat = flatten_config(data)
    with _mlflow_errors(tracking_uri, f"logging config to run {run_id!r}"):
        existing = client.get_run(run_id).data.params
        changed = sorted(k for k, v in flat.items() if k in existing and existing[k] != v)
        fresh = [Param(k, v) for k, v in flat.items() if k not in existing]
        for start in range(0, len(fresh), _PARAMS_PER_BATCH):
            client.log_batch(run_id, params=fresh[start : start + _PARAMS_PER_BATCH])
        if changed:
            logger.warning(
                "run %s resumed with a changed config; MLflow params keep their first value "
                "for: %s",
                run_id,
                ", ".join(changed),
            )
        stamp = time.strftime("-%Y%m%dT%H%M%SZ", time.gmtime()) if changed else ""
        with tempfile.TemporaryDirectory(prefix="sluice-config-") as tmp:
            path = Path(tmp) / f"resolved_config{stamp}.yaml"
            path.write_text(yaml.safe_dump(data, sort_keys=False))
            client.log_artifact(run_id, str(path), artifact_path=artifact_dir)
    return changed


# ---------------------------------------------------------------- metrics


def loggable(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics `log_metrics` stores, as floats: None, NaN and +-inf left out. A value
    float() cannot read raises ValueError naming its key."""
    numbers: dict[str, float] = {}
    for key, value in metrics.items():
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {key!r} has a non-numeric value {value!r}") from None
        if math.isfinite(number):
            numbers[str(key)] = number
    return numbers


def log_metrics(
    tracking_uri: str,
    run_id: str,
    metrics: Mapping[str, Any],
    step: int,
    *,
    timestamp_ms: int | None = None,
) -> int:
    """Log `metrics` at `step` in as few requests as MLflow allows; return how many were logged.

    None, NaN and +-inf values are skipped (a metric that is undefined this step, such as
    an accuracy over zero samples, must not crash training). Values only need float():
    Python numbers, numpy scalars and 0-d tensors all work. A value float() cannot read,
    or a key MLflow rejects, raises ValueError naming the key.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"metric step must be an int, got {step!r}")
    client = _client_for(tracking_uri, run_id)
    when = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
    entries = [
        Metric(key=key, value=number, timestamp=when, step=step)
        for key, number in loggable(metrics).items()
    ]
    for start in range(0, len(entries), _METRICS_PER_BATCH):
        chunk = entries[start : start + _METRICS_PER_BATCH]
        try:
            client.log_batch(run_id, metrics=chunk)
        except MlflowException as exc:
            if exc.error_code == "INVALID_PARAMETER_VALUE":
                raise ValueError(
                    f"MLflow rejected metrics for run {run_id!r}: {exc.message}"
                ) from exc
            raise TrackingError(
                f"logging metrics failed at {redact_uri(tracking_uri)}: {exc.message}"
            ) from exc
    return len(entries)


def get_metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric, ordered by step (for reports and tests)."""
    return sorted(
        (step, value) for step, value, _ in get_metric_timeline(tracking_uri, run_id, key)
    )


def get_metric_timeline(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """(step, value, timestamp_ms) of one metric, ordered by step then time.

    The timestamp is when the logging process recorded the value (ms since the epoch),
    which is what plots against wall-clock time need.
    """
    client = _client_for(tracking_uri, run_id)
    with _mlflow_errors(tracking_uri, f"reading metric {key!r} of run {run_id!r}"):
        history = client.get_metric_history(run_id, key)
    timeline = [(int(m.step), float(m.value), int(m.timestamp)) for m in history]
    return sorted(timeline, key=lambda point: (point[0], point[2]))


# ---------------------------------------------------------------- artifacts


def log_artifact_file(
    tracking_uri: str, run_id: str, local_path: str | Path, artifact_path: str | None = None
) -> None:
    """Copy one local file into the run's artifacts (under `artifact_path` if given)."""
    path = Path(local_path)
    if not path.is_file():
        raise FileNotFoundError(f"artifact file {str(path)!r} does not exist")
    client = _client_for(tracking_uri, run_id)
    with _mlflow_errors(tracking_uri, f"logging artifact {path.name!r} to run {run_id!r}"):
        client.log_artifact(run_id, str(path), artifact_path=artifact_path)


def log_figure_png(
    tracking_uri: str, run_id: str, figure: Any, artifact_file: str, *, dpi: int = 100
) -> None:
    """Store a figure as a PNG artifact at `artifact_file` (e.g. 'plots/reward.png').

    `figure` is anything with ``savefig`` (a matplotlib Figure) or the PNG bytes
    themselves; matplotlib is never imported here.
    """
    if not artifact_file.endswith(".png"):
        raise ValueError(f"artifact_file must end with .png, got {artifact_file!r}")
    client = _client_for(tracking_uri, run_id)
    directory, _, filename = artifact_file.rpartition("/")
    with tempfile.TemporaryDirectory(prefix="sluice-figure-") as tmp:
        path = Path(tmp) / filename
        if isinstance(figure, bytes | bytearray):
            path.write_bytes(bytes(figure))
        elif hasattr(figure, "savefig"):
            figure.savefig(path, format="png", dpi=dpi)
        else:
            raise ValueError(f"figure must have savefig() or be PNG bytes, got {type(figure)}")
        with _mlflow_errors(tracking_uri, f"logging figure {artifact_file!r} to run {run_id!r}"):
            client.log_artifact(run_id, str(path), artifact_path=directory or None)
