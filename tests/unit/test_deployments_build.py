"""`sluice serve` builds the same three deployments as prefect.yaml, without an API."""

from pathlib import Path

import pytest
import yaml

from sluice.infra.config.run import RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
# Nothing listens here: a deployment build that reached for an API would fail loudly.
UNREACHABLE_API = "http://127.0.0.1:9/api"


@pytest.fixture(scope="module")
def no_api():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: UNREACHABLE_API}):
        yield


@pytest.fixture(scope="module")
def served_config():
    return load_config("default", ["trainer.total_steps=7", "staleness.max_staleness=2"])


@pytest.fixture(scope="module")
def deployments(no_api, served_config):
    from sluice.flows.deployments import build_deployments

    return {d.name: d for d in build_deployments(served_config)}


def prefect_yaml_deployments():
    return {
        d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    }


def test_serve_builds_the_deployments_prefect_yaml_declares(deployments):
    # train-docker runs on a Docker work pool, in Sluice's image; `sluice serve` runs
    # every flow in its own process, so it serves the others.
    declared = {
        name: spec
        for name, spec in prefect_yaml_deployments().items()
        if spec["work_pool"]["name"] != "sluice-docker"
    }
    assert set(deployments) == set(declared) == {"train", "train-sync", "reproduce-nightly"}
    for name, spec in declared.items():
        # prefect.yaml names a file (flows/train.py:train); serve names the module, which
        # is imported as sluice.flows.train.
        path, function = spec["entrypoint"].split(":")
        module = "sluice." + path.removesuffix(".py").replace("/", ".")
        assert deployments[name].entrypoint == f"{module}.{function}"
        assert set(deployments[name].tags) == set(spec["tags"])
        assert deployments[name].work_pool_name is None  # serve mode needs no pool


def test_served_config_is_the_default_parameter_of_train_and_train_sync(deployments, served_config):
    from prefect.utilities.schema_tools import validate

    for name in ("train", "train-sync"):
        deployment = deployments[name]
        config = deployment.parameters["config"]
        assert RunConfig.model_validate(config) == served_config
        # The server enforces the flow's parameter schema on every run it creates.
        schema = deployment._parameter_openapi_schema.model_dump_for_openapi()
        assert validate(deployment.parameters, schema, raise_on_error=True) == []


def test_reproduce_runs_nightly_at_three_utc_on_the_pinned_config(deployments):
    declared = prefect_yaml_deployments()["reproduce-nightly"]
    deployment = deployments["reproduce-nightly"]
    assert deployment.flow_name == "sluice-reproduce"
    assert deployment.parameters == declared["parameters"] == {"config_name": "reproduce"}
    [schedule] = deployment.schedules
    [declared_schedule] = declared["schedules"]
    assert schedule.schedule.cron == declared_schedule["cron"] == "0 3 * * *"
    assert schedule.schedule.timezone == declared_schedule["timezone"] == "UTC"
    assert schedule.active


def test_reproduce_follows_where_the_served_config_stores_runs_not_what_it_trains(no_api):
    from sluice.flows.deployments import build_deployments

    served = load_config(
        "default",
        [
            "trainer.total_steps=3",
            "storage.url=s3://sluice/runs",
            "storage.options={endpoint_url: 'http://minio:9000'}",
            "tracking.uri=http://mlflow:5000",
            "tracking.artifact_location=null",
        ],
    )
    reproduce = {d.name: d for d in build_deployments(served)}["reproduce-nightly"]
    overrides = reproduce.parameters["overrides"]
    pinned = load_config("reproduce")
    reproduced = load_config("reproduce", overrides)
    assert reproduced.storage == served.storage
    assert reproduced.tracking.uri == "http://mlflow:5000"
    assert reproduced.tracking.artifact_location is None
    assert reproduced.trainer == pinned.trainer  # the pinned run itself is untouched


def test_next_steps_name_the_run_command_and_the_ui(deployments):
    from sluice.flows.deployments import next_steps

    text = next_steps(
        list(deployments.values()), "http://127.0.0.1:4200/api", "http://127.0.0.1:4200"
    )
    assert "prefect deployment run sluice-train/train" in text
    assert "http://127.0.0.1:4200/deployments" in text
    assert "sluice-reproduce/reproduce-nightly (nightly 03:00 UTC)" in text
    without_api = next_steps(list(deployments.values()), None, None)
    assert "prefect server start" in without_api and "PREFECT_API_URL" in without_api


def test_serve_from_cli_serves_the_built_deployments(no_api, monkeypatch, capsys):
    import prefect

    from sluice.flows.cli import run_serve as serve_from_cli

    served = []
    monkeypatch.setattr(prefect, "serve", lambda *d, **kwargs: served.extend(d))
    assert serve_from_cli(load_config("default")) == 0
    assert [d.name for d in served] == ["train", "train-sync", "reproduce-nightly"]
    assert "prefect deployment run sluice-train/train" in capsys.readouterr().out
