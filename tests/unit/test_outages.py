"""Outages: which errors are one, how a service is probed, how long a supervisor waits,
and what the run says when it stops (infra/outages.py, tasks/process/supervisor.py)."""

from __future__ import annotations

import http.server
import logging
import socket
import sys
import threading
from collections.abc import Iterator

import pytest
import requests
from botocore.exceptions import EndpointConnectionError, ReadTimeoutError
from mlflow.exceptions import MlflowException
from prefect.states import Failed

from sluice.infra.checkpoints import CheckpointIncomplete
from sluice.infra.outages import EXIT_OUTAGE, describe, outage_cause, probe_storage, probe_tracking
from sluice.infra.registry import RegistryError
from sluice.infra.streams.errors import StreamStorageError
from sluice.tasks.process.supervisor import (
    RoleFailed,
    ServiceOutage,
    StopWithoutTraceback,
    forget_stop,
    may_retry,
    stop_roles,
    wait_for_services,
)
from sluice.tasks.role import DAMAGED_MARK, EXIT_DAMAGED, stop_on_lasting_failure


def _raised(exc: BaseException, *wrappers: BaseException) -> BaseException:
    """`exc` raised inside each of `wrappers` in turn (innermost first), as code chains them."""
    try:
        try:
            raise exc
        except BaseException as inner:
            current = inner
            for wrapper in wrappers:
                try:
                    raise wrapper from current
                except BaseException as outer:
                    current = outer
            raise current from current.__cause__
    except BaseException as raised:
        return raised


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield int(sock.getsockname()[1])


@pytest.fixture
def answering_url() -> Iterator[str]:
    """An HTTP server that answers every request with an error (501: no GET)."""

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_connection_and_timeout_errors_are_outages_through_any_wrapping() -> None:
    refused = ConnectionRefusedError(111, "Connection refused")
    mlflow_chain = _raised(
        refused,
        requests.exceptions.ConnectionError("Max retries exceeded"),
        MlflowException("API request failed"),
        RegistryError("reading alias failed"),
    )
    assert outage_cause(mlflow_chain) is refused  # the deepest: it names what failed
    s3_chain = _raised(
        ReadTimeoutError(endpoint_url="http://127.0.0.1:9000/b/k"),
        StreamStorageError("cannot read s3://b/k"),
    )
    assert isinstance(outage_cause(s3_chain), ReadTimeoutError)
    assert isinstance(outage_cause(EndpointConnectionError(endpoint_url="http://x")), Exception)
    assert outage_cause(TimeoutError()) is not None


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad value"),
        FileNotFoundError("s3://b/missing"),
        PermissionError("access denied"),
        OSError(28, "No space left on device"),
        MlflowException("RESOURCE_ALREADY_EXISTS"),
        _raised(KeyError("field"), StreamStorageError("cannot decode")),
    ],
)
def test_answers_and_local_failures_are_not_outages(error: BaseException) -> None:
    assert outage_cause(error) is None


def test_describe_is_one_short_line() -> None:
    assert describe(TimeoutError()) == "TimeoutError"
    assert describe(ValueError("a\n  b")) == "ValueError: a b"
    assert len(describe(ValueError("x" * 1000))) == 300


def test_a_role_stops_with_the_outage_exit_code_only_for_an_outage(caplog) -> None:
    with pytest.raises(SystemExit) as stopped, caplog.at_level(logging.ERROR, "sluice"):
        stop_on_lasting_failure(
            "rollout", _raised(ConnectionRefusedError(111, "refused"), OSError("x"))
        )
    assert stopped.value.code == EXIT_OUTAGE
    assert "rollout stops: a service stopped answering (ConnectionRefusedError" in caplog.text
    # Anything else is left to the caller, which re-raises it.
    assert stop_on_lasting_failure("rollout", ValueError("a bug")) is None


def test_a_role_that_finds_a_committed_checkpoint_damaged_stops_with_its_own_code(caplog) -> None:
    damaged = CheckpointIncomplete("checkpoint file:///c/v000002 is missing model.safetensors")
    with pytest.raises(SystemExit) as stopped, caplog.at_level(logging.ERROR, "sluice"):
        stop_on_lasting_failure("train", damaged)
    assert stopped.value.code == EXIT_DAMAGED
    assert f"train stops: {DAMAGED_MARK}checkpoint file:///c/v000002 is missing" in caplog.text


def test_probes_tell_an_answering_service_from_a_refused_or_hung_one(
    tmp_path, silent_port: int, answering_url: str
) -> None:
    assert probe_storage(tmp_path.as_uri()) is None
    assert probe_storage(str(tmp_path / "not-there")) is None  # "no such file" is an answer
    assert probe_tracking(answering_url) is None  # an error status is an answer
    assert probe_tracking(f"sqlite:///{tmp_path}/mlflow.db") is None
    refused = probe_tracking(f"http://127.0.0.1:{closed_port()}", timeout_s=2)
    assert refused is not None and "Connection refused" in refused
    hung = probe_tracking(f"http://127.0.0.1:{silent_port}", timeout_s=0.5)
    assert hung is not None
    options = {
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{closed_port()}"},
        "key": "k",
        "secret": "s",
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    down = probe_storage("s3://bucket/run", options, timeout_s=20)
    assert down is not None and "ConnectionRefusedError" in down


def test_the_supervisor_waits_then_stops_the_run_in_one_line(
    tmp_path, local_run_config, answering_url: str
) -> None:
    config = local_run_config(
        tmp_path, f"tracking.uri=http://127.0.0.1:{closed_port()}", "outage_timeout_s=1"
    )
    log = logging.getLogger("sluice.test")
    with pytest.raises(ServiceOutage) as stopped:
        wait_for_services(config, "train", "run-1", since=0.0, log=log)
    message = str(stopped.value)
    assert message.startswith("run run-1 stopped: the tracking server http://127.0.0.1:")
    assert "Connection refused" in message and "outage_timeout_s=1" in message
    assert message.endswith("continue with: sluice train --resume run-1")
    assert "\n" not in message
    with pytest.raises(ServiceOutage, match="start the synchronous run again$"):
        wait_for_services(config, "sync", "run-1", since=0.0, log=log)

    stop_roles("run-2")  # the flow stopped the run: no more waiting
    try:
        assert wait_for_services(config, "train", "run-2", since=0.0, log=log) is False
    finally:
        forget_stop("run-2")
    answering = local_run_config(tmp_path, f"tracking.uri={answering_url}")
    assert wait_for_services(answering, "train", "run-3", since=0.0, log=log) is True


def test_an_outage_that_outlasted_the_wait_is_not_retried_by_prefect() -> None:
    assert may_retry(None, None, Failed(data=ServiceOutage("down"))) is False
    assert may_retry(None, None, Failed(data=RoleFailed("exit 1"))) is True


def test_prefect_logs_an_outage_without_its_traceback() -> None:
    def record(exc: BaseException) -> logging.LogRecord:
        try:
            raise exc
        except BaseException:
            info = sys.exc_info()
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, "f", 1, "failed", (), info)

    quiet = StopWithoutTraceback()
    outage, bug = record(ServiceOutage("run x stopped")), record(ValueError("bug"))
    assert quiet.filter(outage) and quiet.filter(bug)
    assert outage.exc_info is None
    assert bug.exc_info is not None
