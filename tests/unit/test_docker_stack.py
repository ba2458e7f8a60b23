"""infra/docker/compose.yaml wires the services together with config keys that still exist."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import load_config

DOCKER = Path(__file__).resolve().parents[2] / "infra" / "docker"
SLUICE_COMMANDS = ("sluice", "sluice-serve")


def interpolate(text: str) -> str:
    """Compose's `${NAME:-default}` with the environment empty, as a fresh checkout sees it."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: m.group(2) or "", text)


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(interpolate((DOCKER / "compose.yaml").read_text()))


def sluice_args(service: dict) -> tuple[str, str, list[str]]:
    """(subcommand, config, overrides) of a `sluice ...` service command."""
    command = service["command"]
    command = shlex.split(command) if isinstance(command, str) else list(command)
    assert command[0] == "sluice", command
    subcommand, config, rest = command[1], command[2], command[3:]
    assert rest[0::2] == ["--set"] * (len(rest) // 2) and len(rest) % 2 == 0, rest
    return subcommand, config, rest[1::2]


def test_stack_has_prefect_mlflow_minio_and_sluice(compose):
    services = compose["services"]
    assert {"prefect-server", "mlflow", "minio", "sluice"} <= set(services)
    assert services["prefect-server"]["command"][:3] == ["prefect", "server", "start"]
    mlflow = services["mlflow"]["command"]
    assert mlflow[:2] == ["mlflow", "server"]
    assert mlflow[mlflow.index("--backend-store-uri") + 1].startswith("sqlite:////data/mlflow/")
    assert "--serve-artifacts" in mlflow and "--artifacts-destination" in mlflow
    assert services["minio"]["command"][0] == "server"


def test_every_named_volume_is_declared_and_every_dependency_exists(compose):
    services = compose["services"]
    declared = set(compose["volumes"])
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            assert source in declared, f"{name}: volume {source} is not declared"
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"


def test_sluice_services_reach_the_stack_by_service_name(compose):
    services = compose["services"]
    for name in SLUICE_COMMANDS:
        service = services[name]
        _, _, overrides = sluice_args(service)
        settings = dict(o.split("=", 1) for o in overrides)
        assert settings["storage.url"].startswith("s3://")
        assert "http://minio:9000" in settings["storage.options"]
        assert settings["tracking.uri"] == "http://mlflow:5000"
        assert service["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
        assert service["environment"]["AWS_ACCESS_KEY_ID"]  # s3fs finds MinIO's keys here
        assert {"prefect-server", "mlflow", "create-bucket"} <= set(service["depends_on"])
    assert sluice_args(services["sluice"])[0] == "train"
    assert sluice_args(services["sluice-serve"])[0] == "serve"


@pytest.mark.parametrize("name", SLUICE_COMMANDS)
def test_sluice_service_config_validates(compose, name):
    _, config_name, overrides = sluice_args(compose["services"][name])
    config = load_config(config_name, overrides)  # a renamed or mistyped key fails here
    assert config.storage.options == {"endpoint_url": "http://minio:9000"}
    assert config.tracking.artifact_location is None  # artifacts go through the server
    assert config.workdir.startswith("/data/")


def test_a_renamed_key_in_the_service_command_would_fail(compose):
    _, config_name, overrides = sluice_args(compose["services"]["sluice"])
    with pytest.raises(ConfigError, match="unknown config key 'storage.uri'"):
        load_config(config_name, [o.replace("storage.url", "storage.uri") for o in overrides])


def test_dockerfile_builds_on_slim_python_with_the_lock_and_cpu_torch():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert 'pip install -c requirements.lock ".${EXTRAS:+[$EXTRAS]}"' in dockerfile
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        for source in line.split()[:-1]:  # the build context is the repository root
            assert (DOCKER.parents[1] / source).exists(), f"COPY {source}: no such path"


def test_the_dockerfile_copies_the_package_and_every_folder_it_links_to():
    import tomllib

    root = DOCKER.parents[1]
    dockerfile = (DOCKER / "Dockerfile").read_text()
    copied = {
        source.rstrip("/")
        for line in re.findall(r"^COPY (.+)$", dockerfile, re.M)
        for source in line.split()[:-1]
    }
    project = tomllib.loads((root / "pyproject.toml").read_text())
    where = project["tool"]["setuptools"]["packages"]["find"].get("where", ["."])
    package = root / where[0] / "sluice"
    linked = {
        entry.resolve().relative_to(root).parts[0]
        for entry in package.iterdir()
        if entry.is_symlink()
    }
    assert linked, f"{package} links to no folder"
    needed = linked | {package.relative_to(root).parts[0]}
    assert needed <= copied, f"the Dockerfile does not COPY {sorted(needed - copied)}"


def test_docker_files_name_modules_through_the_sluice_package():
    # `python -m infra.x`, `"-m", "infra.x"`, `import flows`, `from tasks import ...`
    bare = re.compile(r'(-m"?,? *"?|\bimport |\bfrom )(engines|infra|tasks|flows)\b')
    files = [
        *DOCKER.iterdir(),
        DOCKER.parent / "docker_servers.py",
        DOCKER.parent / "docker_sandbox.py",
    ]
    for path in files:
        if path.is_file():
            for number, line in enumerate(path.read_text().splitlines(), 1):
                assert not bare.search(line), f"{path.name}:{number}: {line.strip()}"


def test_docker_clients_outwait_a_container_create_on_vfs(monkeypatch):
    from sluice.infra import docker_sandbox, docker_servers

    # The SDK's default (60 s) is less than creating a container of sluice:local takes
    # on a cold vfs engine; the sandbox's small image needs less.
    monkeypatch.delenv("DOCKER_CLIENT_TIMEOUT", raising=False)
    assert docker_servers.api_timeout_s() >= 300
    assert docker_servers.api_timeout_s(docker_sandbox.API_TIMEOUT_S) >= 60
    monkeypatch.setenv("DOCKER_CLIENT_TIMEOUT", "900")
    assert docker_servers.api_timeout_s() == 900
    assert docker_servers.api_timeout_s(docker_sandbox.API_TIMEOUT_S) == 900
    monkeypatch.setenv("DOCKER_CLIENT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DOCKER_CLIENT_TIMEOUT must be seconds"):
        docker_servers.api_timeout_s()
