"""Storage primitives: atomic puts, staged directories, fresh listings.

Local disks (tmp_path) and fsspec's in-process ``memory://``; the S3 protocol runs the
same put invariants in ``tests/integration/test_storage_s3.py``. Failures are injected
at each step a real crash could hit (mid-copy, fsync, rename, the PUT itself).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from sluice.infra import storage
from sluice.infra.storage import (
    TEMP_PREFIX,
    exists,
    link_file,
    list_names,
    open_filesystem,
    put_atomic,
    put_file,
    replace_directory,
    staging_directory,
    sweep_temps,
)


class InjectedFault(OSError):
    """A write dying at the injected point."""


def payloads(seed: int, count: int) -> list[bytes]:
    """Distinct payloads of different lengths: any partial read matches none of them."""
    rng = random.Random(seed)
    return [bytes([index % 251]) * rng.randint(1, 300_000) for index in range(count)]


@pytest.fixture(params=["file", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, str]:
    """(filesystem, a fresh directory path on it)."""
    if request.param == "file":
        return open_filesystem(f"file://{tmp_path}/store")
    return open_filesystem(f"memory://storage-{uuid.uuid4().hex[:10]}")


# --------------------------------------------------------------------------- atomic puts


def test_concurrent_reader_sees_only_whole_objects(backend: tuple[Any, str]) -> None:
    fs, root = backend
    path = f"{root}/doc.bin"
    written = payloads(seed=0, count=40)
    whole = set(written)
    seen: list[bytes] = []
    done = threading.Event()

    def read_until_done() -> None:
        while not done.is_set():
            try:
                seen.append(fs.cat_file(path))
            except FileNotFoundError:
                seen.append(b"")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, also in the middle of a put
    reader = threading.Thread(target=read_until_done)
    reader.start()
    try:
        for data in written:
            put_atomic(fs, path, data)
            reads = len(seen)
            while len(seen) == reads:  # let the reader in between puts too
                time.sleep(0)
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert len(seen) >= len(written)
    assert all(data in whole for data in seen if data)  # never a part of a payload
    assert fs.cat_file(path) == written[-1]


def test_put_file_copies_and_replaces(backend: tuple[Any, str], tmp_path: Path) -> None:
    fs, root = backend
    for data in payloads(seed=1, count=3):
        source = tmp_path / "source.bin"
        source.write_bytes(data)
        put_file(fs, source, f"{root}/nested/weights.bin")
        assert fs.cat_file(f"{root}/nested/weights.bin") == data


@pytest.mark.parametrize("step", ["write", "fsync", "rename"])
def test_failed_local_put_keeps_the_old_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    fs, root = open_filesystem(str(tmp_path))
    path = f"{root}/doc.bin"
    put_atomic(fs, path, b"old")
    source = tmp_path / "new.bin"
    source.write_bytes(b"n" * 100_000)

    def dies_half_way(reader: Any, writer: Any, length: int = 0) -> None:
        writer.write(reader.read(50_000))
        raise InjectedFault("disk full")

    def fails(*args: Any, **kwargs: Any) -> None:
        raise InjectedFault(f"{step} failed")

    if step == "write":
        monkeypatch.setattr(shutil, "copyfileobj", dies_half_way)
    else:
        monkeypatch.setattr(os, "fsync" if step == "fsync" else "replace", fails)
        with pytest.raises(InjectedFault):
            put_atomic(fs, path, b"n" * 100_000)
    with pytest.raises(InjectedFault):
        put_file(fs, source, path)
    monkeypatch.undo()
    assert (tmp_path / "doc.bin").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["doc.bin", "new.bin"]  # no temp file left


class _FailingPutMemoryFS(MemoryFileSystem):
    """The memory filesystem whose PUTs (files opened for writing) fail."""

    protocol = "failingput"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode:
            raise InjectedFault("connection reset")
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("failingput", _FailingPutMemoryFS, clobber=True)


def test_failed_object_put_leaves_the_old_object(tmp_path: Path) -> None:
    root = f"storage-{uuid.uuid4().hex[:10]}"
    good, _ = open_filesystem(f"memory://{root}")
    put_atomic(good, f"/{root}/doc.bin", b"old")
    failing, path = open_filesystem(f"failingput://{root}/doc.bin")
    source = tmp_path / "new.bin"
    source.write_bytes(b"new")
    with pytest.raises(InjectedFault):
        put_atomic(failing, path, b"new")
    with pytest.raises(InjectedFault):
        put_file(failing, source, path)
    assert good.cat_file(f"/{root}/doc.bin") == b"old"


def test_put_file_on_an_object_store_reads_the_source_before_the_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs, root = open_filesystem(f"memory://storage-{uuid.uuid4().hex[:10]}")
    source = tmp_path / "weights.bin"
    source.write_bytes(b"w" * 1000)

    def unreadable(self: Path) -> bytes:
        raise InjectedFault("I/O error")

    monkeypatch.setattr(Path, "read_bytes", unreadable)
    with pytest.raises(InjectedFault):
        put_file(fs, source, f"{root}/weights.bin")
    monkeypatch.undo()
    assert not fs.exists(f"{root}/weights.bin")


def test_link_file_links_replaces_and_declines_what_it_cannot_link(tmp_path: Path) -> None:
    """A hard link on one local file system (replacing what was there, no temp left);
    False and nothing written for an object store or another file system, so the caller
    copies."""
    source = tmp_path / "weights.bin"
    source.write_bytes(b"new weights")
    target = tmp_path / "store" / "weights.bin"
    target.parent.mkdir()
    target.write_bytes(b"old")
    local = fsspec.filesystem("file")
    assert link_file(local, source, str(target)) is True
    assert target.read_bytes() == b"new weights"
    assert target.stat().st_ino == source.stat().st_ino
    assert sorted(p.name for p in target.parent.iterdir()) == ["weights.bin"]

    memory = MemoryFileSystem()
    assert link_file(memory, source, f"/linked-{uuid.uuid4().hex}/w.bin") is False
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        return  # no second local file system here: the object store case stands alone
    elsewhere = shm / f"sluice-link-{uuid.uuid4().hex}"
    try:
        assert link_file(local, source, str(elsewhere / "w.bin")) is False
        assert list(elsewhere.iterdir()) == []  # the folder may be made; no file, no temp
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


def test_stale_temps_are_swept_and_fresh_ones_spared(tmp_path: Path) -> None:
    stale, fresh = tmp_path / f"{TEMP_PREFIX}a.part", tmp_path / f"{TEMP_PREFIX}b.part"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    (tmp_path / "data.bin").write_bytes(b"x")
    old = os.path.getmtime(stale) - 7200
    os.utime(stale, (old, old))
    assert sweep_temps(str(tmp_path), older_than_s=3600) == [str(stale)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh.name, "data.bin"]


# --------------------------------------------------------------------------- directories


def test_staged_directory_appears_whole_and_replaces_what_was_there(tmp_path: Path) -> None:
    target = tmp_path / "ckpt" / "v000001"
    target.mkdir(parents=True)
    (target / "leftover.bin").write_bytes(b"half")
    with staging_directory(target) as staging:
        assert staging.parent == target.parent and staging.name.startswith(".")
        (staging / "sub").mkdir()
        (staging / "sub" / "weights.bin").write_bytes(b"w" * 1000)
        (staging / "config.json").write_text("{}")
        assert (target / "leftover.bin").exists()  # nothing visible until the rename
        replace_directory(staging, target)
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*")) == [
        "config.json",
        "sub",
        "sub/weights.bin",
    ]
    assert [p.name for p in target.parent.iterdir()] == ["v000001"]  # no staging, no trash


def test_failure_while_staging_leaves_the_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "ckpt" / "v000001"
    with pytest.raises(InjectedFault), staging_directory(target) as staging:
        (staging / "weights.bin").write_bytes(b"half")
        raise InjectedFault("killed mid-save")
    assert list(target.parent.iterdir()) == []
    target.mkdir()
    (target / "old.bin").write_bytes(b"old")
    with staging_directory(target) as staging:
        (staging / "new.bin").write_bytes(b"new")
        # The caller decides not to publish (a concurrent writer won): staging goes away.
    assert [p.name for p in target.parent.iterdir()] == ["v000001"]
    assert [p.name for p in target.iterdir()] == ["old.bin"]


# --------------------------------------------------------------------------- listings


class _CachingMemoryFS(MemoryFileSystem):
    """A memory filesystem that caches listings, as s3fs does by default."""

    protocol = "cachingmem"

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        key = self._strip_protocol(path).rstrip("/")
        if key not in self.dircache:
            self.dircache[key] = super().ls(path, detail=True, **kwargs)
        entries = self.dircache[key]
        return entries if detail else [entry["name"] for entry in entries]

    def invalidate_cache(self, path: str | None = None) -> None:
        if path is None:
            self.dircache.clear()
        else:
            self.dircache.pop(self._strip_protocol(path).rstrip("/"), None)


fsspec.register_implementation("cachingmem", _CachingMemoryFS, clobber=True)


def test_listings_are_fresh_even_on_a_caching_filesystem() -> None:
    fs, root = open_filesystem(f"cachingmem://storage-{uuid.uuid4().hex[:10]}")
    put_atomic(fs, f"{root}/a", b"1")
    assert list_names(fs, root) == ["a"]
    put_atomic(fs, f"{root}/b", b"2")
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] == ["a"]  # stale
    assert sorted(list_names(fs, root)) == ["a", "b"]  # list_names dropped the cache
    assert exists(fs, f"{root}/b")
    assert list_names(fs, f"{root}/missing") == []


def test_s3_is_opened_without_a_listings_cache() -> None:
    pytest.importorskip("s3fs")
    fs, path = open_filesystem("s3://bucket/prefix", {"anon": True})
    assert path == "bucket/prefix"
    assert not fs.dircache.use_listings_cache
    assert storage.protocols(fs)[0] == "s3"
    # An explicit choice is respected.
    cached, _ = open_filesystem("s3://bucket/prefix", {"anon": True, "use_listings_cache": True})
    assert cached.dircache.use_listings_cache
