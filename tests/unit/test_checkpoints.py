"""Checkpoints: the manifest marks completeness, and every way of being incomplete is caught.

Storage is real: local directories under tmp_path and fsspec's in-process memory://
filesystem. Faults (a crash mid-upload) are injected by a memory filesystem subclass that
fails on a chosen write, since a real crash cannot be scheduled from a test.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from sluice.infra.checkpoint_cache import fetch_checkpoint, prune_checkpoint_cache
from sluice.infra.checkpoints import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointIncomplete,
    save_checkpoint,
    verify_checkpoint,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _memory_url() -> str:
    return f"memory://sluice-test-{uuid.uuid4().hex[:12]}/ckpt"


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


@pytest.fixture
def hf_dir(tiny_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny policy directory (an HF model and tokenizer) to alter."""
    copy = tmp_path / "source"
    shutil.copytree(tiny_dir, copy)
    return copy


# ---------------------------------------------------------------- save + verify


def test_save_to_local_disk_writes_files_and_a_manifest_that_verifies(hf_dir, tmp_path):
    url = save_checkpoint(hf_dir, f"file://{tmp_path}/runs/r/checkpoints/v000001")

    target = tmp_path / "runs/r/checkpoints/v000001"
    assert url == f"file://{target}"
    assert _tree_bytes(target) == _tree_bytes(hf_dir)
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    listed = {f["name"]: (f["size_bytes"], f["sha256"]) for f in manifest["files"]}
    expected = {
        name: (len(data), hashlib.sha256(data).hexdigest())
        for name, data in _tree_bytes(hf_dir).items()
    }
    assert listed == expected
    assert "model.safetensors" in listed and "tokenizer.json" in listed
    assert verify_checkpoint(url).digest == verify_checkpoint(str(target)).digest
    # Nothing but the checkpoint itself is left in the parent: staging went away by rename.
    assert [p.name for p in target.parent.iterdir()] == ["v000001"]


def test_a_linked_save_shares_the_bytes_and_outlives_its_source(hf_dir, tmp_path):
    """`link=True` (the trainer's own versions): each file is a hard link, not a copy; the
    checkpoint verifies with hashes, and deleting the source folder (as the trainer does
    with its older local copies) leaves it whole."""
    expected = _tree_bytes(hf_dir)
    url = save_checkpoint(hf_dir, f"file://{tmp_path}/store/v000001", link=True)
    target = tmp_path / "store/v000001"
    for name in expected:
        assert (target / name).stat().st_ino == (hf_dir / name).stat().st_ino, name
    shutil.rmtree(hf_dir)
    assert _tree_bytes(target) == expected
    assert verify_checkpoint(url, check_hashes=True).digest
    assert [p.name for p in target.parent.iterdir()] == ["v000001"]


def test_a_linked_save_copies_where_no_link_can_be_made(hf_dir):
    """An object store (and a local target on another file system) takes a copy."""
    url = save_checkpoint(hf_dir, _memory_url(), link=True)
    assert verify_checkpoint(url, check_hashes=True).digest


def test_missing_manifest_is_incomplete(hf_dir, tmp_path):
    url = save_checkpoint(hf_dir, str(tmp_path / "ck"))
    (tmp_path / "ck" / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointIncomplete, match=f"incomplete: no {MANIFEST_NAME}"):
        verify_checkpoint(url)


def test_truncated_safetensors_is_incomplete_even_without_hashing(hf_dir, tmp_path):
    url = save_checkpoint(hf_dir, str(tmp_path / "ck"))
    weights = tmp_path / "ck" / "model.safetensors"
    full_size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(
        CheckpointIncomplete, match=rf"model.safetensors has 100 bytes, manifest says {full_size}"
    ):
        verify_checkpoint(url, check_hashes=False)


def test_missing_file_is_incomplete(hf_dir, tmp_path):
    url = save_checkpoint(hf_dir, str(tmp_path / "ck"))
    (tmp_path / "ck" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointIncomplete, match="tokenizer.json is missing"):
        verify_checkpoint(url)


def test_same_size_corruption_is_caught_by_the_hash_check_only(hf_dir, tmp_path):
    url = save_checkpoint(hf_dir, str(tmp_path / "ck"))
    weights = tmp_path / "ck" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    verify_checkpoint(url, check_hashes=False)  # sizes still match
    with pytest.raises(CheckpointIncomplete, match="model.safetensors does not match its sha256"):
        verify_checkpoint(url)


def test_garbage_manifest_is_reported_not_crashed_on(hf_dir, tmp_path):
    url = save_checkpoint(hf_dir, str(tmp_path / "ck"))
    (tmp_path / "ck" / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointIncomplete, match="is not JSON"):
        verify_checkpoint(url)
    (tmp_path / "ck" / MANIFEST_NAME).write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointIncomplete, match="not a Sluice manifest"):
        verify_checkpoint(url)


def test_saving_the_same_weights_again_is_a_no_op_and_different_weights_are_refused(
    hf_dir, tmp_path
):
    url = save_checkpoint(hf_dir, str(tmp_path / "ck"))
    manifest_before = (tmp_path / "ck" / MANIFEST_NAME).read_bytes()
    assert save_checkpoint(hf_dir, str(tmp_path / "ck")) == url
    assert (tmp_path / "ck" / MANIFEST_NAME).read_bytes() == manifest_before

    (hf_dir / "config.json").write_text('{"changed": true}')
    with pytest.raises(CheckpointError, match="already exists with different content"):
        save_checkpoint(hf_dir, str(tmp_path / "ck"))
    assert (tmp_path / "ck" / MANIFEST_NAME).read_bytes() == manifest_before


def test_a_damaged_copy_of_the_same_weights_is_repaired_by_saving_again(hf_dir, tmp_path):
    url = save_checkpoint(hf_dir, str(tmp_path / "ck"))
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"short")
    save_checkpoint(hf_dir, url)
    verify_checkpoint(url)


def test_leftover_directory_without_manifest_is_replaced(hf_dir, tmp_path):
    stale = tmp_path / "ck"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    (stale / "junk.bin").write_bytes(b"x")
    url = save_checkpoint(hf_dir, str(stale))
    verify_checkpoint(url)
    assert _tree_bytes(stale) == _tree_bytes(hf_dir)


def test_sealing_a_directory_in_place_only_adds_the_manifest(hf_dir):
    before = _tree_bytes(hf_dir)
    url = save_checkpoint(hf_dir, f"file://{hf_dir}")
    assert url == f"file://{hf_dir}"
    assert _tree_bytes(hf_dir) == before
    verify_checkpoint(url)


def test_crash_during_local_save_leaves_nothing_at_the_target(hf_dir, tmp_path, monkeypatch):
    import sluice.infra.checkpoints as checkpoints

    real_put = checkpoints.put_file
    calls = {"n": 0}

    def failing_put(fs, source, path):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real_put(fs, source, path)

    monkeypatch.setattr(checkpoints, "put_file", failing_put)
    with pytest.raises(CheckpointError, match="cannot write checkpoint at .*disk full"):
        save_checkpoint(hf_dir, str(tmp_path / "out" / "ck"))
    assert list((tmp_path / "out").iterdir()) == []  # no partial target, no staging dir


def test_bad_sources_give_one_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        save_checkpoint(tmp_path / "nope", str(tmp_path / "ck"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no files"):
        save_checkpoint(tmp_path / "empty", str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match="non-empty string"):
        verify_checkpoint("")


# ---------------------------------------------------------------- object storage


class _CrashingMemoryFS(MemoryFileSystem):
    """The in-process memory filesystem, failing the N-th file opened for writing."""

    protocol = "crashmem"
    fail_on_write: int | None = None
    writes: list[str] = []

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            type(self).writes.append(path)
            if len(type(self).writes) == type(self).fail_on_write:
                raise OSError("connection reset")
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("crashmem", _CrashingMemoryFS, clobber=True)


def test_object_store_upload_writes_the_manifest_last_and_a_crash_leaves_it_incomplete(hf_dir):
    url = f"crashmem://sluice-test-{uuid.uuid4().hex[:12]}/ckpt"
    _CrashingMemoryFS.writes = []
    _CrashingMemoryFS.fail_on_write = None
    save_checkpoint(hf_dir, url)
    assert _CrashingMemoryFS.writes[-1].endswith(MANIFEST_NAME)
    assert len(_CrashingMemoryFS.writes) == len(_tree_bytes(hf_dir)) + 1

    # A crash on every possible write: never a manifest, so never "complete"; retry heals.
    for crash_at in range(1, len(_tree_bytes(hf_dir)) + 2):
        fresh = f"crashmem://sluice-test-{uuid.uuid4().hex[:12]}/ckpt"
        _CrashingMemoryFS.writes = []
        _CrashingMemoryFS.fail_on_write = crash_at
        with pytest.raises(CheckpointError, match="connection reset"):
            save_checkpoint(hf_dir, fresh)
        with pytest.raises(CheckpointIncomplete, match="no sluice_manifest.json"):
            verify_checkpoint(fresh)
        _CrashingMemoryFS.fail_on_write = None
        save_checkpoint(hf_dir, fresh)
        verify_checkpoint(fresh)


def test_memory_fetch_is_verified_and_cached_by_manifest_digest(hf_dir, tmp_path):
    url = save_checkpoint(hf_dir, _memory_url())
    assert url.startswith("memory:///")
    cache = tmp_path / "cache"
    local = fetch_checkpoint(url, cache)
    assert local.parent == cache
    assert _tree_bytes(local) == _tree_bytes(hf_dir)
    verify_checkpoint(str(local))

    # Cache hit: the remote weights are gone, yet a second fetch returns the same copy.
    fs, path = fsspec.core.url_to_fs(url)
    fs.rm_file(f"{path}/model.safetensors")
    assert fetch_checkpoint(url, cache) == local
    # The same weights under another URL share the cached copy too.
    assert fetch_checkpoint(save_checkpoint(hf_dir, _memory_url()), cache) == local


def test_fetch_refuses_a_corrupt_remote_copy_and_leaves_no_cache_entry(hf_dir, tmp_path):
    url = save_checkpoint(hf_dir, _memory_url())
    fs, path = fsspec.core.url_to_fs(url)
    data = bytearray(fs.cat_file(f"{path}/model.safetensors"))
    data[10] ^= 0x01
    fs.pipe_file(f"{path}/model.safetensors", bytes(data))
    with pytest.raises(CheckpointIncomplete, match="model.safetensors does not match its sha256"):
        fetch_checkpoint(url, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_fetching_a_local_checkpoint_returns_it_without_copying(hf_dir, tmp_path):
    url = save_checkpoint(hf_dir, str(tmp_path / "ck"))
    assert fetch_checkpoint(url, tmp_path / "cache") == tmp_path / "ck"
    assert not (tmp_path / "cache").exists()
    with pytest.raises(CheckpointIncomplete):
        fetch_checkpoint(str(hf_dir), tmp_path / "cache")  # unsealed: not a committed checkpoint


def test_prune_keeps_the_most_recent_fetched_copies(hf_dir, tmp_path):
    import os

    cache = tmp_path / "cache"
    copies = []
    for i in range(3):
        (hf_dir / "generation_config.json").write_text(json.dumps({"i": i}))
        copies.append(fetch_checkpoint(save_checkpoint(hf_dir, _memory_url()), cache))
        os.utime(copies[-1], (1_000_000 + i, 1_000_000 + i))  # fetched in this order
    (cache / "unrelated").mkdir()
    removed = prune_checkpoint_cache(cache, keep_latest=1)
    assert sorted(removed) == sorted(copies[:2])
    assert sorted(p.name for p in cache.iterdir()) == sorted([copies[2].name, "unrelated"])


def test_fetches_into_one_cache_reuse_a_digest_and_keep_the_newest_copies(
    hf_dir, tmp_path, monkeypatch
):
    import sluice.infra.checkpoint_cache as checkpoint_cache

    downloads = []
    real_download = checkpoint_cache._download_verified

    def counting_download(fs, path, url, manifest, staging):
        downloads.append(url)
        return real_download(fs, path, url, manifest, staging)

    monkeypatch.setattr(checkpoint_cache, "_download_verified", counting_download)
    cache = tmp_path / "cache"
    versions = []
    for i in range(3):
        (hf_dir / "generation_config.json").write_text(json.dumps({"i": i}))
        versions.append(save_checkpoint(hf_dir, _memory_url()))
    first = fetch_checkpoint(versions[0], cache, keep_latest=2)
    assert len(downloads) == 1

    # A second fetch of the same digest, from another URL (a later version with the same
    # weights), is a cache hit: same directory, nothing downloaded.
    (hf_dir / "generation_config.json").write_text(json.dumps({"i": 0}))
    same_weights = save_checkpoint(hf_dir, _memory_url())
    assert fetch_checkpoint(same_weights, cache, keep_latest=2) == first
    assert len(downloads) == 1

    # Every fetch prunes the cache to the newest keep_latest copies.
    second = fetch_checkpoint(versions[1], cache, keep_latest=2)
    third = fetch_checkpoint(versions[2], cache, keep_latest=2)
    assert len(downloads) == 3
    assert sorted(p.name for p in cache.iterdir()) == sorted([second.name, third.name])
    assert not first.exists()
    # The newest copy is the one just fetched, even when it was already cached.
    assert fetch_checkpoint(versions[1], cache, keep_latest=1) == second
    assert [p.name for p in cache.iterdir()] == [second.name]
    with pytest.raises(CheckpointError, match="keep_latest must be >= 1"):
        fetch_checkpoint(versions[1], cache, keep_latest=0)


def test_pruning_never_deletes_a_copy_another_process_is_still_loading(hf_dir, tmp_path):
    """The evaluate role, `sluice eval` and the benchmark share one cache and all prune it."""
    cache = tmp_path / "cache"
    (hf_dir / "generation_config.json").write_text(json.dumps({"i": 0}))
    other_source = tmp_path / "v0"
    shutil.copytree(hf_dir, other_source)
    # The other process fetches version 0 and is still loading it when told to go on.
    script = (
        "import sys\n"
        "from sluice.infra.checkpoint_cache import fetch_checkpoint\n"
        "from sluice.infra.checkpoints import save_checkpoint, verify_checkpoint\n"
        f"url = save_checkpoint({str(other_source)!r}, 'memory://other-process/v0')\n"
        f"local = fetch_checkpoint(url, {str(cache)!r}, keep_latest=2)\n"
        "print(local, flush=True)\n"
        "sys.stdin.readline()\n"
        "verify_checkpoint(str(local))\n"
        "print('loaded', flush=True)\n"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        held = Path(other.stdout.readline().strip())
        assert held.parent == cache, other.stderr.read()
        # Meanwhile this process fetches three newer versions, pruning to two each time.
        newer = []
        for i in (1, 2, 3):
            (hf_dir / "generation_config.json").write_text(json.dumps({"i": i}))
            newer.append(
                fetch_checkpoint(save_checkpoint(hf_dir, _memory_url()), cache, keep_latest=2)
            )
        assert held.is_dir()  # in use: kept beyond keep_latest
        assert not newer[0].exists()  # not in use: pruned as before
        out, err = other.communicate("go\n", timeout=120)
    finally:
        other.kill()
        other.wait()
    assert other.returncode == 0, err
    assert out.splitlines() == ["loaded"]
    # Its holder has exited: the next fetch prunes it like any other copy.
    fetch_checkpoint(save_checkpoint(hf_dir, _memory_url()), cache, keep_latest=2)
    assert sorted(p.name for p in cache.iterdir()) == sorted([newer[1].name, newer[2].name])


def test_random_trees_round_trip_and_any_truncation_is_detected(tmp_path):
    rng = random.Random(1234)
    for trial in range(6):
        source = tmp_path / f"src{trial}"
        for i in range(rng.randint(1, 6)):
            depth = rng.randint(0, 2)
            rel = Path(*[f"d{rng.randint(0, 1)}" for _ in range(depth)], f"f{i}.bin")
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            (source / rel).write_bytes(rng.randbytes(rng.randint(1, 5000)))
        for url in (str(tmp_path / f"dst{trial}"), _memory_url()):
            saved = save_checkpoint(source, url)
            fetched = fetch_checkpoint(saved, tmp_path / f"cache{trial}")
            assert _tree_bytes(fetched) == _tree_bytes(source)
            # Cut a random file by a random amount: verification must name that file.
            victim = rng.choice(sorted(_tree_bytes(source)))
            fs, path = fsspec.core.url_to_fs(saved)
            data = fs.cat_file(f"{path}/{victim}")
            fs.pipe_file(f"{path}/{victim}", data[: rng.randrange(len(data))])
            with pytest.raises(CheckpointIncomplete, match=victim):
                verify_checkpoint(saved, check_hashes=False)
