"""Choosing a feature whose extra is not installed stops the run in one line that names
the extra and how to install it (infra/extras.py); `reward.sandbox: auto` falls back.

Every extra is installed where the tests run, so these tests make packages missing for
real: a subprocess whose first meta-path finder refuses them, as an install without
them does (`import ray` raises ModuleNotFoundError, and so does looking ray up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.flows.cli import main
from sluice.infra.config.run import load_config
from sluice.infra.extras import check_extras, module_installed, needed_extras

UNINSTALLED = {
    "cluster": ("ray", "prefect_ray"),
    "megatron": ("megatron",),
    "docker": ("docker", "prefect_docker"),
}
"""The top-level modules an install without each extra lacks."""
EVERY_EXTRA_SETTING = [
    "cluster.engine=ray",
    "trainer.backend=megatron",
    "servers.launch=docker",
    "reward.verifier=code",
    "reward.sandbox=docker",
]

REFUSE_MODULES = """
import sys


class RefuseModules:
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, RefuseModules({names!r}))
"""


def python_without(modules: tuple[str, ...], code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where `modules` cannot be imported."""
    script = REFUSE_MODULES.format(names=set(modules)) + code
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        # Were a refused package imported after all, no Docker engine would answer it.
        env={**os.environ, "DOCKER_HOST": f"unix://{cwd / 'no-engine.sock'}"},
    )


def sluice_without(modules: tuple[str, ...], argv: list[str], cwd: Path):
    """`sluice ARGV` (python -m sluice.flows.cli) where `modules` cannot be imported."""
    run_cli = (
        "import runpy\n"
        f"sys.argv = ['sluice', *{argv!r}]\n"
        "runpy.run_module('sluice.flows.cli', run_name='__main__', alter_sys=True)\n"
    )
    return python_without(modules, run_cli, cwd)


def install_line(setting: str, extra: str, packages: str) -> str:
    return (
        f"sluice: error: {setting} needs the '{extra}' extra ({packages}), not installed "
        f'here: pip install -c requirements.lock -e ".[{extra}]"'
    )


@pytest.mark.parametrize(
    ("argv", "extra", "setting", "packages"),
    [
        (
            ["train", "--dry-run", "cluster.engine=ray"],
            "cluster",
            "cluster.engine=ray",
            "ray, prefect-ray",
        ),
        (
            ["train", "--dry-run", "trainer.backend=megatron"],
            "megatron",
            "trainer.backend=megatron",
            "megatron-core",
        ),
        (
            ["train", "--dry-run", "servers.launch=docker"],
            "docker",
            "servers.launch=docker",
            "docker, prefect-docker",
        ),
        (
            ["train", "--dry-run", "reward.verifier=code", "reward.sandbox=docker"],
            "docker",
            "reward.sandbox=docker",
            "docker, prefect-docker",
        ),
        (
            ["bench", "staleness", "--eta", "0", "--seeds", "1", "cluster.engine=ray"],
            "cluster",
            "cluster.engine=ray",
            "ray, prefect-ray",
        ),
        (
            ["serve", "servers.launch=docker"],
            "docker",
            "servers.launch=docker",
            "docker, prefect-docker",
        ),
    ],
    ids=[
        "train-cluster",
        "train-megatron",
        "train-docker-servers",
        "train-docker-sandbox",
        "bench",
        "serve",
    ],
)
def test_a_feature_without_its_extra_is_refused_in_one_line_that_says_how_to_install_it(
    tmp_path, argv, extra, setting, packages
):
    proc = sluice_without(UNINSTALLED[extra], [*argv, f"workdir={tmp_path}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [install_line(setting, extra, packages)]
    assert proc.stdout == ""  # nothing printed, so nothing started
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def flows_without_extras(tmp_path_factory) -> dict[str, str]:
    """What a deployment run's flow entry and the reward role's sandbox choice do when no
    extra is installed: one interpreter, since importing the flows takes seconds."""
    tmp_path = tmp_path_factory.mktemp("without-extras")
    code = f"""
import json, logging
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from sluice.flows.train import train
from sluice.flows.train_sync import train_sync
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import load_config
from sluice.infra.docker_sandbox import SandboxUnavailable
from sluice.tasks.sandbox import code_sandbox

here = ["workdir={tmp_path}", "storage.url=file://{tmp_path}/runs"]
result = {{}}
for name, flow, setting in [
    ("train", train, "cluster.engine=ray"),
    ("train_sync", train_sync, "trainer.backend=megatron"),
]:
    try:  # the flow's own body, as a deployment run calls it, without a Prefect API
        flow.fn(config=load_config("default", [*here, setting]))
    except ConfigError as err:
        result[name] = str(err)
result["auto"] = repr(code_sandbox(load_config("default", [*here, "reward.verifier=code"])))
try:
    code_sandbox(load_config("default", [*here, "reward.verifier=code", "reward.sandbox=docker"]))
except SandboxUnavailable as err:
    result["docker"] = str(err)
print("RESULT", json.dumps(result))
"""
    every_module = tuple(m for modules in UNINSTALLED.values() for m in modules)
    proc = python_without(every_module, code, tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1].removeprefix("RESULT "))
    result["stderr"] = proc.stderr
    return result


def test_a_deployment_run_without_the_extra_fails_in_the_flow_with_the_same_line(
    flows_without_extras,
):
    prefix = "sluice: error: "
    cluster = install_line("cluster.engine=ray", "cluster", "ray, prefect-ray")
    megatron = install_line("trainer.backend=megatron", "megatron", "megatron-core")
    assert flows_without_extras["train"] == cluster.removeprefix(prefix)
    assert flows_without_extras["train_sync"] == megatron.removeprefix(prefix)


def test_an_auto_sandbox_without_the_docker_package_runs_code_in_the_process_sandbox(
    flows_without_extras,
):
    assert flows_without_extras["auto"] == "None"  # None: the process sandbox
    said = [
        line
        for line in flows_without_extras["stderr"].splitlines()
        if "reward.sandbox=auto" in line
    ]
    assert len(said) == 1 and "'docker' extra" in said[0] and "process sandbox" in said[0]
    # `docker` insists, in the role as in the CLI.
    assert "needs the 'docker' extra" in flows_without_extras["docker"]


def test_with_every_extra_installed_nothing_is_refused(tmp_path, capsys):
    config = load_config("default", EVERY_EXTRA_SETTING)
    assert {extra for _, extra in needed_extras(config)} == {"cluster", "megatron", "docker"}
    check_extras(config)
    assert main(["train", "--dry-run", *EVERY_EXTRA_SETTING, f"workdir={tmp_path}"]) == 0
    assert capsys.readouterr().err == ""


def test_the_default_run_needs_no_extra():
    assert needed_extras(load_config("default")) == []


def test_a_module_that_is_not_there_is_not_installed():
    assert not module_installed("sluice_no_such_module")
    assert not module_installed("sluice_no_such_package.core")  # its parent is missing


def test_checking_the_extras_imports_none_of_their_packages(tmp_path):
    code = (
        "import sys\n"
        "from sluice.infra.config.run import load_config\n"
        "from sluice.infra.extras import check_extras\n"
        f"check_extras(load_config('default', {EVERY_EXTRA_SETTING!r}))\n"
        "print('IMPORTED', sorted(m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'prefect_ray', 'megatron', 'docker', 'prefect_docker')))\n"
    )
    proc = python_without((), code, tmp_path)
    # `megatron` alone: the namespace package, which runs no code (looking megatron.core
    # up imports its parent).
    assert proc.stdout.splitlines()[-1:] == ["IMPORTED ['megatron']"], proc.stderr
