"""A secret-bearing config leaves no secret wherever it leaves the process.

The attack: an operator puts S3 keys in ``storage.options`` and a password in
``tracking.uri``; anyone who reads the MLflow run, the run's files, the Prefect
deployments, the dry-run output or an error line must not learn them, while the roles
still get the real values. MLflow is a real sqlite store; the secret-bearing tracking
URI points at loopback and is never contacted except where a test says so (a closed
loopback port).
"""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from sluice.flows.cli import main  # noqa: E402
from sluice.flows.run_claim import write_resolved_config  # noqa: E402
from sluice.flows.run_secrets import hand_over, take_secrets  # noqa: E402
from sluice.infra.config.overrides import ConfigError  # noqa: E402
from sluice.infra.config.run import RunConfig, load_config  # noqa: E402
from sluice.infra.secrets import REDACTED, redact_config, redact_text  # noqa: E402
from tests.conftest import local_run_settings  # noqa: E402

ACCESS_KEY = "AKIAEXAMPLESECRET0042"
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzEXAMPLEKEY"
SESSION = "FwoGZXIvYXdzEXAMPLEsessionTOKEN"
PASSWORD = "hunter2-correct-horse"
SECRETS = (ACCESS_KEY, SECRET_KEY, SESSION, PASSWORD)


def _secret_overrides(tmp_path: Path, port: int = 5000) -> list[str]:
    settings = local_run_settings(tmp_path)
    options = {
        "key": ACCESS_KEY,
        "secret": SECRET_KEY,
        "client_kwargs": {"aws_session_token": SESSION, "region_name": "eu-west-1"},
    }
    return [
        *(f"{k}={v}" for k, v in settings.items() if k != "tracking.uri"),
        f"storage.options={json.dumps(options)}",
        f"tracking.uri=http://user:{PASSWORD}@127.0.0.1:{port}",
    ]


def _assert_clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


def test_the_mlflow_params_and_config_artifact_hold_no_secret(tracking_uri, tmp_path):
    from sluice.infra.tracking import get_client, log_config, start_or_resume_run

    config = load_config(None, _secret_overrides(tmp_path))
    run_id = start_or_resume_run(tracking_uri, f"secrets-{tmp_path.name}", run_name="r")
    log_config(tracking_uri, run_id, config.model_dump(mode="json"))
    client = get_client(tracking_uri)
    params = client.get_run(run_id).data.params
    _assert_clean(json.dumps(params))
    assert params["storage.options.key"] == REDACTED  # the key is shown as set
    assert params["storage.options.client_kwargs.region_name"] == "eu-west-1"
    assert params["tracking.uri"] == f"http://user:{REDACTED}@127.0.0.1:5000"
    downloaded = Path(client.download_artifacts(run_id, "config", str(tmp_path / "dl")))
    texts = [p.read_text() for p in downloaded.rglob("*") if p.is_file()]
    assert texts and all(REDACTED in t for t in texts)
    _assert_clean("".join(texts))


def test_roles_read_the_real_values_from_a_0600_config(tmp_path):
    real = load_config(None, _secret_overrides(tmp_path))
    run_id = "t-secret-run"
    shown = hand_over(real, run_id)  # what the CLI passes as the flow's parameter
    _assert_clean(json.dumps(shown.model_dump(mode="json")))
    secrets_file = Path(real.workdir) / "runs" / run_id / "secrets.json"
    assert stat.S_IMODE(secrets_file.stat().st_mode) == 0o600
    in_flow = take_secrets(shown, run_id)  # what the flow restores
    path = write_resolved_config(in_flow, run_id)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # The role side's loader (tasks/process/worker.py, supervisor.supervise_role).
    role = RunConfig.model_validate(json.loads(path.read_text()))
    assert role.storage.options["key"] == ACCESS_KEY
    assert role.storage.options["secret"] == SECRET_KEY
    assert role.storage.options["client_kwargs"]["aws_session_token"] == SESSION
    assert role.tracking.uri == f"http://user:{PASSWORD}@127.0.0.1:5000"
    assert role == real


def test_a_redacted_parameter_without_its_file_fails_in_one_line(tmp_path):
    shown = RunConfig.model_validate(
        redact_config(load_config(None, _secret_overrides(tmp_path)).model_dump(mode="json"))
    )
    with pytest.raises(ConfigError) as refused:
        take_secrets(shown, "never-handed-over")
    assert "\n" not in str(refused.value) and "redacted credentials" in str(refused.value)


def test_the_dry_run_shows_no_secret(tmp_path, capsys):
    assert (
        main(
            ["train", "--dry-run", *(a for o in _secret_overrides(tmp_path) for a in ("--set", o))]
        )
        == 0
    )
    out = capsys.readouterr().out
    _assert_clean(out)
    assert REDACTED in out


@pytest.mark.parametrize(
    "bad",
    [
        # pydantic echoes the bad value: the options are never echoed.
        [f'storage.options=["{ACCESS_KEY}", "{SECRET_KEY}"]'],
        # A rule across sections names the storage URL, userinfo included.
        [
            f"storage.url=ftp://user:{PASSWORD}@127.0.0.1/runs",
            "cluster.engine=ray",
            "cluster.address=127.0.0.1:6379",
        ],
    ],
)
def test_a_config_error_line_shows_no_secret(tmp_path, capsys, bad):
    settings = [f"{k}={v}" for k, v in local_run_settings(tmp_path).items()]
    argv = ["train", "--dry-run", *(a for o in [*settings, *bad] for a in ("--set", o))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluice: error:") and err.count("\n") == 1
    _assert_clean(err)


def test_an_unreachable_tracking_server_is_named_without_its_password():
    from sluice.infra.tracking import TrackingUnavailable, get_client

    with (
        socket.socket() as probe
    ):  # a loopback port nothing listens on (no DNS: no userinfo in the probe)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(TrackingUnavailable) as refused:
        get_client(f"http://user:{PASSWORD}@127.0.0.1:{port}", connect_timeout_s=2)
    assert f"127.0.0.1:{port}" in str(refused.value)
    _assert_clean(str(refused.value))


def test_redact_text_hides_remembered_values_and_uri_passwords(tmp_path):
    load_config(None, _secret_overrides(tmp_path))  # the CLI's load remembers them
    line = f"boto: bad key {ACCESS_KEY} at s3://u:{PASSWORD}@host/b, token {SESSION}"
    _assert_clean(redact_text(line))
