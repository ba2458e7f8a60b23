"""The GPU run's payload, checked offline from what is committed (tests/gpu/).

The device run (tests/gpu/device_run.sh) carries cp312 wheels and SmolLM2's GGUF in a
few calls of at most 64 MiB each, working tree included. These tests read the lock
(tests/gpu/device_wheels.lock) and the device's package list
(tests/gpu/device_packages.txt), never the network or the built bundle: a fresh clone
checks that every call fits and that the carried wheels plus the device's packages meet
every requirement the walk from pyproject.toml reaches.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.gpu import device_bundle, device_deps, device_stage

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lock() -> dict:
    return device_deps.read_lock()


def test_every_device_call_fits_the_64_mib_limit_with_the_working_tree(lock):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to size the working tree")
    tree = device_bundle.tree_bytes()
    calls = device_bundle.plan(lock)
    assert len(calls) >= 2, "the GGUF alone is over one call"
    for call in calls:
        assert call["bytes"] <= device_bundle.CARRY_BUDGET
        assert tree + call["bytes"] <= 64 * 2**20, (
            f"call {call['call']}: tree {tree / 2**20:.1f} MiB + carry "
            f"{call['bytes'] / 2**20:.1f} MiB is over 64 MiB"
        )
    if (ROOT / ".device" / "call1" / "manifest.json").is_file():  # built here: the real sizes
        for call in calls:
            folder = ROOT / ".device" / f"call{call['call']}"
            built = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            assert tree + built <= 64 * 2**20, f"{folder}: {built / 2**20:.1f} MiB carried"


def test_the_gguf_parts_cover_the_file_once_in_order(lock):
    parts = device_bundle.gguf_parts(lock)
    offset = 0
    for part in parts:
        assert part["offset"] == offset and part["size"] > 0
        offset += part["size"]
    assert offset == lock["gguf"]["size"]
    assert [p["file"] for p in parts] == [f"gguf.part{i}" for i in range(1, len(parts) + 1)]


def test_every_dependency_the_device_lacks_is_a_carried_wheel(lock):
    result, problems = device_deps.check_lock(lock)
    assert problems == []
    for name in ("prefect", "mlflow-skinny", "pydantic", "pydantic-core", "reasoning-gym"):
        assert result.met[name].where.endswith(".whl"), name
    for name in ("gguf", "math-verify", "sqlalchemy", "alembic", "fastapi", "uvicorn"):
        assert name in result.met, name
    for name in ("torch", "transformers", "numpy", "pyarrow", "fsspec", "httpx", "pyyaml"):
        assert result.met[name].where == "device", name


def test_a_requirement_nobody_carries_is_reported_by_name(lock):
    broken = {**lock, "wheels": [w for w in lock["wheels"] if w["name"] != "pydantic-core"]}
    _, problems = device_deps.check_lock(broken)
    assert any(p.startswith("missing: pydantic-core (asked for by") for p in problems), problems
    wrong = {
        **lock,
        "wheels": [
            {**w, "version": "2.0.0"} if w["name"] == "pydantic-core" else w for w in lock["wheels"]
        ],
    }
    _, problems = device_deps.check_lock(wrong)
    assert any(p.startswith("version: pydantic-core 2.0.0 found") for p in problems), problems


def test_markers_are_evaluated_for_python_312_on_linux(lock):
    names = {device_deps.name_of(w["name"]) for w in lock["wheels"]}
    assert "pendulum" in names  # prefect: python_version < '3.13'
    assert "whenever" not in names  # prefect: python_version >= '3.13'
    assert "h2" in names  # httpx[http2], asked for by prefect, on the device without it
    assert not names & set(device_deps.NOT_ON_DEVICE) - {"docker"}  # docker: Prefect's


def test_carried_wheels_install_on_cpython_312_x86_64(lock):
    from packaging import tags
    from packaging.utils import parse_wheel_filename

    platforms = [*device_bundle.PLATFORMS, "linux_x86_64"]
    supported = {
        *tags.cpython_tags((3, 12), platforms=platforms),
        *tags.compatible_tags((3, 12), "cp312", platforms=platforms),
    }
    for wheel in [*lock["wheels"], *lock["fallbacks"]]:
        _, _, _, wheel_tags = parse_wheel_filename(wheel["file"])
        assert wheel_tags & supported, wheel["file"]
        assert wheel["built"] or wheel["sha256"], wheel["file"]
    for wheel in lock["fallbacks"]:
        assert wheel["file"].endswith("-none-any.whl"), wheel["file"]


def test_the_device_package_list_says_where_it_came_from():
    header = [
        line
        for line in device_deps.DEVICE_PACKAGES.read_text().splitlines()
        if line.startswith("#")
    ]
    assert any("2026-11" in line for line in header)
    packages = device_deps.read_device_packages()
    assert str(packages["torch"]) == "2.11.0" and "prefect" not in packages


def test_the_plan_commands_fit_a_device_call():
    script = ROOT / "tests" / "gpu" / "device_run.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for call in (1, 2, 3):
        command = device_bundle.call_command(call, 3)
        assert len(command) <= 2000 and command.endswith("bash tests/gpu/device_run.sh")


# ---------------------------------------------------------------- staging on the device


def fake_bundle(repo: Path, calls: dict[int, dict[str, bytes]], gguf: bytes) -> dict:
    """`.device/call*/` as `build` lays it out, with small made-up files."""
    manifest: dict = {
        "id": "test",
        "gguf": {
            "file": "model.gguf",
            "size": len(gguf),
            "sha256": hashlib.sha256(gguf).hexdigest(),
        },
        "files": [],
    }
    for call, files in calls.items():
        for relative, data in files.items():
            kind, name = relative.split("/")
            target = repo / ".device" / f"call{call}" / kind / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            manifest["files"].append(
                {
                    "call": call,
                    "kind": kind,
                    "name": name,
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            )
    for call in calls:
        (repo / ".device" / f"call{call}" / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def carry_only(bundle: Path, repo: Path, call: int) -> None:
    """The device's copy of the tree holds the carried call alone."""
    shutil.rmtree(repo / ".device", ignore_errors=True)
    shutil.copytree(bundle / ".device" / f"call{call}", repo / ".device" / f"call{call}")


def test_staging_joins_the_gguf_whatever_the_order_of_the_calls(tmp_path, capsys):
    gguf = bytes(random.Random(0).randrange(256) for _ in range(3000))
    bundle = tmp_path / "bundle"
    fake_bundle(
        bundle,
        {
            1: {"wheels/a-1-py3-none-any.whl": b"a" * 10, "gguf/gguf.part1": gguf[:1000]},
            2: {"gguf/gguf.part2": gguf[1000:2000]},
            3: {"gguf/gguf.part3": gguf[2000:]},
        },
        gguf,
    )
    repo, state = tmp_path / "repo", tmp_path / "state"
    carry_only(bundle, repo, 1)
    assert device_stage.stage(repo, state) == 3
    assert "MISSING gguf: gguf.part2 (call 2), gguf.part3 (call 3)" in capsys.readouterr().out
    carry_only(bundle, repo, 3)
    assert device_stage.stage(repo, state) == 3
    carry_only(bundle, repo, 2)
    assert device_stage.stage(repo, state) == 0
    assert (state / "model.gguf").read_bytes() == gguf
    assert (state / "wheels" / "a-1-py3-none-any.whl").read_bytes() == b"a" * 10


def test_staging_names_what_a_cold_machine_lost_and_refuses_a_damaged_part(tmp_path, capsys):
    gguf = b"0123456789" * 50
    bundle = tmp_path / "bundle"
    fake_bundle(
        bundle,
        {1: {"wheels/a-1-py3-none-any.whl": b"a"}, 2: {"gguf/gguf.part1": gguf}},
        gguf,
    )
    repo, state = tmp_path / "repo", tmp_path / "state"
    carry_only(bundle, repo, 2)  # call 1's state is gone: the machine went cold
    assert device_stage.stage(repo, state) == 4
    assert "MISSING wheels: a-1-py3-none-any.whl (call 1)" in capsys.readouterr().out
    carry_only(bundle, repo, 1)
    (repo / ".device" / "call1" / "wheels" / "a-1-py3-none-any.whl").write_bytes(b"b")
    assert device_stage.stage(repo, tmp_path / "fresh") == 2
    assert "DAMAGED" in capsys.readouterr().out
