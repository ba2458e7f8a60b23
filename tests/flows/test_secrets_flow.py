"""A secret-bearing config started with `sluice train` leaves no secret in Prefect.

The attack is reading the Prefect API (its UI, or anyone with the API URL): the flow
run's parameters, its state message, its task runs, and the deployments `sluice serve`
registers. The run is started as the CLI starts it (`run_train`), against a stub MLflow
server on loopback that records what it is sent: it answers the health probe and
refuses the rest, so the flow stops at its first MLflow call, which proves the flow
itself held the real password (it reaches the stub as HTTP basic auth).
"""

from __future__ import annotations

import base64
import http.server
import json
import threading

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.secrets import REDACTED
from tests.conftest import local_run_settings

ACCESS_KEY = "AKIAEXAMPLESECRET0042"
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzEXAMPLEKEY"
PASSWORD = "hunter2-correct-horse"
SECRETS = (ACCESS_KEY, SECRET_KEY, PASSWORD)


class _StubMlflow(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, str | None]] = []

    def _answer(self) -> None:
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        healthy = self.path == "/health"
        body = b"OK" if healthy else json.dumps({"error_code": "ENDPOINT_NOT_FOUND"}).encode()
        self.send_response(200 if healthy else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *_args) -> None:
        pass


@pytest.fixture
def stub_mlflow():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StubMlflow)
    _StubMlflow.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    thread.join(timeout=10)


def _secret_config(tmp_path, port):
    settings = {k: v for k, v in local_run_settings(tmp_path).items() if k != "tracking.uri"}
    return load_config(
        None,
        [
            *(f"{k}={v}" for k, v in settings.items()),
            f'storage.options={{"key": "{ACCESS_KEY}", "secret": "{SECRET_KEY}"}}',
            f"tracking.uri=http://user:{PASSWORD}@127.0.0.1:{port}",
        ],
    )


def _everything_prefect_holds_of(run_name: str) -> tuple[str, list]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_name]))
        )
        ids = [r.id for r in runs]
        tasks = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=ids))
        )
    dumped = json.dumps(
        [r.model_dump(mode="json") for r in runs] + [t.model_dump(mode="json") for t in tasks]
    )
    return dumped, runs


@pytest.mark.usefixtures("prefect_api")
def test_the_flow_run_parameters_hold_no_secret_and_the_flow_holds_the_real_ones(
    tmp_path, stub_mlflow
):
    from sluice.flows.cli_train import run_train

    config = _secret_config(tmp_path, stub_mlflow)
    run_id = "t-secret-flow"
    with pytest.raises(Exception) as stopped:  # the stub refuses every MLflow call
        run_train(config, resume=run_id)
    for secret in SECRETS:
        assert secret not in str(stopped.value)
    dumped, runs = _everything_prefect_holds_of(run_id)
    assert runs, "the flow run was not recorded"
    parameters = json.dumps(runs[0].parameters)
    assert REDACTED in parameters
    for secret in SECRETS:
        assert secret not in dumped
    # The flow called MLflow with the real password: it had it, from the 0600 file.
    credentials = {a for _path, a in _StubMlflow.seen if a}
    assert f"Basic {base64.b64encode(f'user:{PASSWORD}'.encode()).decode()}" in credentials


def test_deployment_parameters_hold_no_secret(tmp_path):
    from sluice.flows.deployments import build_deployments

    deployments = build_deployments(_secret_config(tmp_path, 5000))
    dumped = json.dumps([d.parameters for d in deployments], default=str)
    for secret in SECRETS:
        assert secret not in dumped
    assert all(REDACTED in json.dumps(d.parameters) for d in deployments)
