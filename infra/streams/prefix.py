"""One stream's prefix (``{root}/{run}/{stream}/``) on storage, with errors that name the URL.

A thin adapter over ``sluice.infra.storage``: the writer and the reader call it for every storage
operation, and it turns backend failures into ``StreamStorageError`` (retry later) while
letting ``FileNotFoundError`` through (the reader tells a vanished shard from a broken one).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from sluice.infra import storage
from sluice.infra.streams.errors import StreamConfigError, StreamError, StreamStorageError
from sluice.infra.streams.names import check_name

STALE_TEMP_AGE_S = 3600.0
"""Age after which a temp file in a stream is a dead writer's leftover and is deleted."""


class StreamPrefix:
    """One stream prefix on one fsspec filesystem, with atomic puts and clear errors."""

    def __init__(
        self, url: str, run: str, stream: str, storage_options: Mapping[str, Any] | None
    ) -> None:
        if not isinstance(url, str) or not url:
            raise StreamConfigError(f"stream storage URL must be a non-empty string, got {url!r}")
        self.url = url
        self.run = check_name("run", run)
        self.stream = check_name("stream", stream)
        try:
            self.fs, root = storage.open_filesystem(url, storage_options)
        except Exception as error:
            raise StreamConfigError(f"cannot open stream storage {url!r}: {error}") from error
        self.is_local = storage.is_local(self.fs)
        root = root.rstrip("/")
        self.root = root
        self.prefix = f"{root}/{run}/{stream}" if root else f"{run}/{stream}"
        self.prefix_url = self.url_of(self.prefix)

    def url_of(self, path: str) -> str:
        return storage.url_of(self.fs, path)

    @contextlib.contextmanager
    def guard(self, action: str, path: str) -> Iterator[None]:
        """Turn storage failures into one ``StreamStorageError`` naming the URL."""
        try:
            yield
        except (StreamError, FileNotFoundError):
            raise
        except Exception as error:
            raise StreamStorageError(
                f"cannot {action} {self.url_of(path)} (stream storage {self.url!r}): "
                f"{type(error).__name__}: {error}"
            ) from error

    def probe(self, create: bool) -> None:
        """Fail fast, naming the URL, when the storage is unreachable or the bucket missing."""
        if self.is_local:
            if create:
                with self.guard("create directory", self.prefix):
                    self.fs.makedirs(self.prefix, exist_ok=True)
            return
        if "memory" in storage.protocols(self.fs):
            return  # in-process: nothing to reach
        bucket = self.root.split("/", 1)[0]
        if not bucket:
            raise StreamConfigError(f"stream storage URL {self.url!r} names no bucket")
        try:
            with self.guard("reach", bucket):
                self.fs.info(bucket)
        except FileNotFoundError as error:
            raise StreamStorageError(
                f"bucket {bucket!r} of stream storage {self.url!r} does not exist"
            ) from error

    def list_names(self, directory: str) -> list[str]:
        """Fresh listing of base names in ``directory``; a missing directory is empty."""
        with self.guard("list", directory):
            return storage.list_names(self.fs, directory)

    def put_atomic(self, path: str, data: bytes) -> None:
        """Make ``data`` visible at ``path`` all at once, or not at all."""
        try:
            with self.guard("write", path):
                storage.put_atomic(self.fs, path, data)
        except FileNotFoundError as error:
            raise StreamStorageError(
                f"cannot write {self.url_of(path)} (stream storage {self.url!r}): {error}"
            ) from error

    def read_buffer(self, path: str) -> pa.Buffer:
        """The bytes at ``path`` as an Arrow buffer (memory-mapped on local disks)."""
        with self.guard("read", path):
            if self.is_local:
                if os.path.getsize(path) == 0:
                    return pa.py_buffer(b"")
                with pa.memory_map(path, "r") as mapped:
                    return mapped.read_buffer()
            return pa.py_buffer(self.fs.cat_file(path))

    def exists(self, path: str) -> bool:
        with self.guard("check", path):
            return storage.exists(self.fs, path)

    def move(self, source: str, destination: str) -> None:
        with self.guard("move", source):
            storage.rename(self.fs, source, destination)

    def remove(self, path: str) -> None:
        with self.guard("remove", path):
            self.fs.rm_file(path)

    def cat_many(self, paths: list[str]) -> dict[str, bytes]:
        """The bytes of every path, keyed by path as given (one batched request)."""
        if not paths:
            return {}
        with self.guard("read", paths[0]):
            found = self.fs.cat(paths)
        by_path = {str(path): data for path, data in found.items()}
        # Some backends key the answer by URL: look each path up both ways.
        return {
            path: by_path[path] if path in by_path else by_path.get(self.url_of(path), b"")
            for path in paths
        }

    def sweep_stale_temps(self) -> None:
        """Delete temp files that writers which died mid-commit left in the prefix."""
        if self.is_local:
            storage.sweep_temps(self.prefix, STALE_TEMP_AGE_S)
