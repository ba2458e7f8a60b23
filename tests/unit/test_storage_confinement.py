"""Storage stays in its place: a hostile manifest or registry entry cannot write or load
anything outside the run's own files.

Each test is the attack of someone who can write the bucket or the MLflow registry: a
manifest whose names climb out of the fetch cache, a link planted inside the staging
folder, bytes that fail their hash, a model version whose source is another bucket. Every
one is refused in one line naming the entry, and nothing lands outside the copy.
Storage is fsspec's in-process memory:// filesystem (a "remote" store: the fetch
downloads) and MLflow a real sqlite store.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid

import fsspec
import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from sluice.infra.checkpoint_cache import _download_verified, fetch_checkpoint  # noqa: E402
from sluice.infra.checkpoints import (  # noqa: E402
    MANIFEST_NAME,
    CheckpointIncomplete,
    ForeignCheckpoint,
    Manifest,
    ManifestEntry,
    read_manifest,
    save_checkpoint,
)
from sluice.infra.registry import CheckpointRegistry  # noqa: E402


def _hostile_checkpoint(names_and_bytes: dict[str, bytes], *, lie_about: str | None = None) -> str:
    """A memory:// checkpoint whose manifest lists `names_and_bytes` verbatim (the
    attacker writes the manifest by hand), each file stored under the literal key."""
    fs = fsspec.filesystem("memory")
    root = f"/hostile-{uuid.uuid4().hex[:12]}/ckpt"
    files = []
    for name, data in names_and_bytes.items():
        fs.pipe_file(f"{root}/{name}", data)
        sha = hashlib.sha256(b"other bytes" if name == lie_about else data).hexdigest()
        files.append({"name": name, "size_bytes": len(data), "sha256": sha})
    manifest = {
        "format": "sluice-checkpoint",
        "format_version": 1,
        "created_at_unix_s": time.time(),
        "files": files,
    }
    fs.pipe_file(f"{root}/{MANIFEST_NAME}", json.dumps(manifest).encode())
    return f"memory://{root}"


@pytest.mark.parametrize("climb", ["../../escaped.pth", "{outside}/escaped.pth"])
def test_a_manifest_name_cannot_write_outside_the_cache(tmp_path, climb):
    outside = tmp_path / "site-packages"
    outside.mkdir()
    name = climb.format(outside=outside)
    url = _hostile_checkpoint({"config.json": b"{}", name: b"import os  # code on every node"})
    cache = tmp_path / "cache" / "deep" / "er"
    with pytest.raises(CheckpointIncomplete) as refused:
        fetch_checkpoint(url, cache)
    message = str(refused.value)
    assert "\n" not in message and repr(name) in message
    assert not list(tmp_path.rglob("escaped.pth"))  # not in the cache, not beside it
    assert not (outside / "escaped.pth").exists()


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("a/../../b", "'..'"),
        ("weights\\..\\..\\x", "backslash"),
        ("model\x00.safetensors", "NUL"),
        ("dir//model.safetensors", "empty part"),
        ("./model.safetensors", "'.'"),
    ],
)
def test_manifest_names_are_plain_relative_paths(name, why):
    url = _hostile_checkpoint({"config.json": b"{}"})
    fs, path = fsspec.core.url_to_fs(url)
    raw = json.loads(fs.cat_file(f"{path}/{MANIFEST_NAME}"))
    raw["files"].append({"name": name, "size_bytes": 1, "sha256": "0" * 64})
    fs.pipe_file(f"{path}/{MANIFEST_NAME}", json.dumps(raw).encode())
    with pytest.raises(CheckpointIncomplete, match=why) as refused:
        read_manifest(url)
    assert "\n" not in str(refused.value)


def test_a_link_planted_in_the_staging_folder_is_not_followed(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"precious")
    url = _hostile_checkpoint({"sub/model.safetensors": b"new", "model.safetensors": b"new"})
    fs, path = fsspec.core.url_to_fs(url)
    manifest = read_manifest(url)
    # Someone sharing the node plants links in the staging folder before the download.
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "sub").symlink_to(outside)
    with pytest.raises(CheckpointIncomplete, match="not a plain directory"):
        _download_verified(fs, path, url, manifest, staging)
    assert (outside / "model.safetensors").read_bytes() == b"precious"
    # A link at a file's own name is replaced, never written through.
    (staging / "sub").unlink()
    (staging / "model.safetensors").symlink_to(outside / "model.safetensors")
    _download_verified(fs, path, url, manifest, staging)
    assert (outside / "model.safetensors").read_bytes() == b"precious"
    assert (staging / "model.safetensors").read_bytes() == b"new"
    assert not (staging / "model.safetensors").is_symlink()


def test_bytes_that_fail_their_hash_never_sit_under_their_name(tmp_path):
    url = _hostile_checkpoint(
        {"a.json": b"{}", "model.safetensors": b"forged"}, lie_about="model.safetensors"
    )
    fs, path = fsspec.core.url_to_fs(url)
    staging = tmp_path / "staging"
    staging.mkdir()
    with pytest.raises(CheckpointIncomplete, match="sha256"):
        _download_verified(fs, path, url, read_manifest(url), staging)
    assert sorted(p.name for p in staging.iterdir()) == ["a.json"]  # no temp file either


def test_an_honest_checkpoint_still_fetches(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "sub" / "tokenizer.json").write_text('{"v": 1}')
    url = save_checkpoint(model, f"memory://honest-{uuid.uuid4().hex[:12]}/v0")
    local = fetch_checkpoint(url, tmp_path / "cache")
    assert (local / "sub" / "tokenizer.json").read_text() == '{"v": 1}'


# ---------------------------------------------------------------- registry sources


def _checkpoint_at(url: str) -> str:
    fs, path = fsspec.core.url_to_fs(url)
    data = b'{"weights": "whoever wrote this"}'
    fs.pipe_file(f"{path}/model.safetensors", data)
    entry = ManifestEntry(
        name="model.safetensors", size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()
    )
    manifest = Manifest(created_at_unix_s=time.time(), files=(entry,))
    fs.pipe_file(f"{path}/{MANIFEST_NAME}", manifest.to_json().encode())
    return url


def test_a_registry_writer_cannot_point_the_run_at_another_bucket(tracking_uri):
    run = f"memory://bucket-{uuid.uuid4().hex[:8]}/run-1/checkpoints"
    name = f"policy-{uuid.uuid4().hex[:8]}"
    registry = CheckpointRegistry(tracking_uri, name, source_root=run)
    registry.commit(0, _checkpoint_at(f"{run}/v000000"))
    # The attacker writes MLflow directly: a newer version whose source is theirs
    # (plain, and dressed up as the run's own prefix climbing out).
    for step, source in [
        (1, _checkpoint_at(f"memory://attacker-{uuid.uuid4().hex[:8]}/evil")),
        (2, f"{run}/../../attacker/evil"),
    ]:
        attacker = CheckpointRegistry(tracking_uri, name)  # no source_root: writes anything
        attacker.commit(step, source, check_files=False, durable=False)
        with pytest.raises(ForeignCheckpoint) as refused:
            registry.newest_servable()
        assert "\n" not in str(refused.value) and "not under the run's checkpoints" in str(
            refused.value
        )
        # Listings leave it out; looking up the step finds nothing to load.
        assert [v.policy_version for v in registry.versions()] == [0]
        assert registry.get(step) is None
    assert registry.newest_durable().policy_version == 0
