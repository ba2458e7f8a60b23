"""Storage primitives over the real S3 protocol (s3fs -> moto's S3 server on loopback).

The put invariants of ``tests/unit/test_storage.py`` where they matter most: an object
store has no rename, so a put must be one PUT, or a multipart upload completed only at
the end and aborted on error. Checkpoints, which used to open S3 with s3fs's listing
cache on, go through the same ``open_filesystem`` as streams.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from sluice.infra.checkpoint_cache import fetch_checkpoint
from sluice.infra.checkpoints import save_checkpoint, verify_checkpoint
from sluice.infra.storage import exists, list_names, open_filesystem, put_atomic, put_file

pytestmark = pytest.mark.integration

S3Root = tuple[str, dict[str, Any]]


class InjectedFault(OSError):
    """The connection dying at the injected request."""


def fail_on(fs: Any, monkeypatch: pytest.MonkeyPatch, method: str, call: int) -> list[str]:
    """Make the `call`-th S3 request named `method` fail; return the methods called."""
    real = fs._call_s3
    calls: list[str] = []

    async def flaky(name: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        if name == method and calls.count(name) == call:
            raise InjectedFault(f"connection reset during {name}")
        return await real(name, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", flaky)
    return calls


def test_put_atomic_and_put_file_replace_whole_objects(s3_root: S3Root, tmp_path: Path) -> None:
    fs, root = open_filesystem(*s3_root)
    put_atomic(fs, f"{root}/doc.json", b"old")
    put_atomic(fs, f"{root}/doc.json", b"new")
    assert fs.cat_file(f"{root}/doc.json") == b"new"
    source = tmp_path / "weights.bin"
    source.write_bytes(b"w" * 100_000)
    put_file(fs, source, f"{root}/weights.bin")
    assert fs.cat_file(f"{root}/weights.bin") == source.read_bytes()


def test_a_failed_put_leaves_the_old_object(
    s3_root: S3Root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs, root = open_filesystem(*s3_root)
    put_atomic(fs, f"{root}/doc.json", b"old")
    source = tmp_path / "new.bin"
    source.write_bytes(b"n" * 1000)
    fail_on(fs, monkeypatch, "put_object", call=1)
    with pytest.raises(InjectedFault):
        put_atomic(fs, f"{root}/doc.json", b"new")
    fail_on(fs, monkeypatch, "put_object", call=1)
    with pytest.raises(InjectedFault):
        put_file(fs, source, f"{root}/doc.json")
    monkeypatch.undo()
    assert fs.cat_file(f"{root}/doc.json") == b"old"


def test_a_multipart_put_file_that_fails_half_way_is_aborted(
    s3_root: S3Root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs.core

    fs, root = open_filesystem(*s3_root)
    # 5 MiB parts (S3's minimum) so an 11 MiB file takes the multipart path.
    monkeypatch.setattr(s3fs.core, "calculate_chunksize", lambda *args, **kwargs: 5 * 2**20)
    source = tmp_path / "weights.bin"
    source.write_bytes(b"w" * (11 * 2**20))
    calls = fail_on(fs, monkeypatch, "upload_part", call=2)
    with pytest.raises(InjectedFault):
        put_file(fs, source, f"{root}/weights.bin")
    assert "create_multipart_upload" in calls and "abort_multipart_upload" in calls
    monkeypatch.undo()
    assert not exists(fs, f"{root}/weights.bin")
    bucket, prefix = root.split("/", 1)
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    assert uploads.get("Uploads", []) == []  # aborted, not left to be completed later


def test_listings_see_new_objects_even_with_the_cache_turned_on(s3_root: S3Root) -> None:
    for cache in (False, True):
        options = {**s3_root[1], "use_listings_cache": cache}
        fs, root = open_filesystem(f"{s3_root[0]}/cache-{cache}", options)
        put_atomic(fs, f"{root}/a", b"1")
        assert list_names(fs, root) == ["a"]
        put_atomic(fs, f"{root}/b", b"2")
        assert sorted(list_names(fs, root)) == ["a", "b"]
        assert exists(fs, f"{root}/b")


def test_checkpoints_save_verify_and_fetch_on_s3(s3_root: S3Root, tmp_path: Path) -> None:
    source = tmp_path / "policy"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "model.safetensors").write_bytes(b"\x01" * 50_000)
    url = save_checkpoint(source, f"{s3_root[0]}/ckpt-{uuid.uuid4().hex[:6]}", s3_root[1])
    assert url.startswith("s3://")
    verify_checkpoint(url, s3_root[1])
    fetched = fetch_checkpoint(url, tmp_path / "cache", s3_root[1], keep_latest=1)
    assert (fetched / "sub" / "model.safetensors").read_bytes() == b"\x01" * 50_000
    # Same weights again: the retry is a no-op and the fetch a cache hit.
    assert save_checkpoint(source, url, s3_root[1]) == url
    assert fetch_checkpoint(url, tmp_path / "cache", s3_root[1], keep_latest=1) == fetched


def test_a_reader_fetches_only_its_part_and_a_deleted_checkpoint_is_gone_on_s3(
    s3_root: S3Root, tmp_path: Path
) -> None:
    from sluice.infra.checkpoints import CheckpointIncomplete, delete_checkpoint

    source = tmp_path / "policy"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "tokenizer.json").write_text('{"model": {}}')
    (source / "model.safetensors").write_bytes(b"\x02" * 80_000)
    url = save_checkpoint(source, f"{s3_root[0]}/ckpt-{uuid.uuid4().hex[:6]}", s3_root[1])
    fs, path = open_filesystem(url, s3_root[1])
    fs.rm_file(f"{path}/model.safetensors")  # a tokenizer reader never asks for it

    tokenizer = fetch_checkpoint(
        url, tmp_path / "cache", s3_root[1], select=lambda name: not name.endswith(".safetensors")
    )
    assert sorted(p.name for p in tokenizer.iterdir()) == [
        "config.json",
        "sluice_manifest.json",
        "tokenizer.json",
    ]

    assert delete_checkpoint(url, s3_root[1]) is True
    assert list_names(fs, path) == []
    with pytest.raises(CheckpointIncomplete):
        verify_checkpoint(url, s3_root[1])
    assert delete_checkpoint(url, s3_root[1]) is False  # nothing left: a retry is a no-op
