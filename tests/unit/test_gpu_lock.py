"""The two install profiles and their locks, checked offline against pyproject.toml.

requirements.lock is the CPU install (the laptop, CI); requirements-gpu.lock is the GPU
profile, `pip install -c requirements-gpu.lock -e ".[sglang]"`, resolved with what
sglang's own metadata pins. pyproject.toml's ranges must hold both, or one of the two
installs stops resolving.
"""

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
GPU_COMMAND = 'pip install -c requirements-gpu.lock -e ".[sglang]"'


def lock_pins(name: str) -> dict[str, str]:
    pins = {}
    for raw in (ROOT / name).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            package, sep, version = line.partition("==")
            assert sep, f"{name}: '{raw}' is not a name==version pin"
            pins[canonicalize_name(package)] = version
    return pins


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_gpu_lock_pins_what_sglang_0_5_23_demands():
    pins = lock_pins("requirements-gpu.lock")
    assert pins["sglang"] == "0.5.23"
    # sglang 0.5.23's Requires-Dist: torch==2.14.1, transformers==5.19.0, tokenizers==0.23.2.
    demanded = {"torch": "2.14.1", "transformers": "5.19.0", "tokenizers": "0.23.2"}
    assert {name: pins[name] for name in demanded} == demanded
    assert project()["optional-dependencies"]["sglang"] == ["sglang==0.5.23"]


@pytest.mark.parametrize(
    ("lock", "extras"), [("requirements.lock", ["test"]), ("requirements-gpu.lock", ["sglang"])]
)
def test_every_dependency_is_locked_within_its_specifier(lock, extras):
    pins = lock_pins(lock)
    declared, asked = list(project()["dependencies"]), list(extras)
    while asked:  # `test` asks for sluice-rl[cluster,megatron,docker]: follow those extras
        for line in project()["optional-dependencies"][asked.pop()]:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == "sluice-rl":
                asked += sorted(requirement.extras)
            else:
                declared.append(line)
    outside = []
    for line in declared:
        requirement = Requirement(line)
        version = pins.get(canonicalize_name(requirement.name))
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            outside.append(f"{line} (locked: {version})")
    assert not outside, f"{lock} does not satisfy pyproject.toml: {outside}"


def test_readme_says_how_to_install_the_gpu_profile():
    assert GPU_COMMAND in (ROOT / "README.md").read_text()
    assert GPU_COMMAND in (ROOT / "docs" / "deployments.md").read_text()
