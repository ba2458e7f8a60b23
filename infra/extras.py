"""Which config choices need which optional extra, checked before anything starts.

A plain install holds what the default run needs; the heavy parts only some runs use
are extras (pyproject.toml's [project.optional-dependencies]). A run that chooses such
a part without its extra is refused in one line that names the setting, the extra and
the install command, instead of an ImportError from a role process minutes later.

The packages are looked up (`importlib.util.find_spec`), never imported: importing Ray
alone takes seconds, and the check runs on every `sluice train`, `--dry-run` included.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.infra.config.overrides import ConfigError

if TYPE_CHECKING:
    from sluice.infra.config.run import RunConfig

INSTALL_COMMAND = 'pip install -c requirements.lock -e ".[{extra}]"'
"""How an extra is installed into the laptop/CI profile (docs/deployments.md)."""


@dataclass(frozen=True)
class Extra:
    """One of pyproject.toml's optional extras, as far as a run needs it."""

    name: str
    """The extra's name in pyproject.toml (`pip install -e ".[name]"`)."""
    packages: tuple[str, ...]
    """The distributions it installs, as pyproject.toml names them."""
    modules: tuple[str, ...]
    """The modules Sluice imports from them: what must be importable for a run."""


EXTRAS: dict[str, Extra] = {
    extra.name: extra
    for extra in (
        Extra("cluster", ("ray", "prefect-ray"), ("ray", "prefect_ray")),
        Extra("megatron", ("megatron-core",), ("megatron.core",)),
        # prefect-docker is the Docker work pool's worker (prefect.yaml): the worker's
        # machine needs it, a run never imports it.
        Extra("docker", ("docker", "prefect-docker"), ("docker",)),
    )
}


def module_installed(module: str) -> bool:
    """Whether `module` can be imported here, without importing it (a dotted name
    imports its parent packages, which for the modules above are light)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or refuses
        return False


def extra_installed(name: str) -> bool:
    return all(module_installed(module) for module in EXTRAS[name].modules)


def needed_extras(config: RunConfig) -> list[tuple[str, str]]:
    """(setting, extra) for each choice in `config` whose code imports an extra."""
    needed = []
    if config.cluster.engine == "ray":  # flows/cluster.py: prefect-ray's task runner
        needed.append(("cluster.engine=ray", "cluster"))
    if config.servers.launch == "ray":  # tasks/process/ray_servers.py: one actor a server
        needed.append(("servers.launch=ray", "cluster"))
    if config.trainer.backend == "megatron":  # engines/megatron/
        needed.append(("trainer.backend=megatron", "megatron"))
    if config.servers.launch == "docker":  # infra/docker_servers.py
        needed.append(("servers.launch=docker", "docker"))
    # Only the `code` verifier runs code; `auto` falls back to the process sandbox
    # without the docker package, as without an engine (tasks/sandbox.py: code_sandbox).
    if config.reward.sandbox == "docker" and config.reward.verifier == "code":
        needed.append(("reward.sandbox=docker", "docker"))
    return needed


def missing_extra_message(setting: str, name: str) -> str:
    """The one line that refuses `setting` for want of extra `name`."""
    extra = EXTRAS[name]
    return (
        f"{setting} needs the '{name}' extra ({', '.join(extra.packages)}), not installed "
        f"here: {INSTALL_COMMAND.format(extra=name)}"
    )


def check_extras(config: RunConfig) -> None:
    """Raise ConfigError, in one line, for the first choice in `config` whose extra is
    not installed here."""
    for setting, name in needed_extras(config):
        if not extra_installed(name):
            raise ConfigError(missing_extra_message(setting, name))
