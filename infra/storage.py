"""Object storage for every Sluice file: open a URL, put bytes atomically, publish directories.

Streams, checkpoints and the run's small control and status documents all go through
here, so they share one notion of "written": a reader sees the old object or the new one,
never a part, and on a local disk the new one survives a power cut once the call returns.

- Local disks: bytes go to a hidden temp file (``TEMP_PREFIX``) in the target directory,
  which is fsynced, renamed into place, and then the directory itself is fsynced, so the
  rename is durable too. A directory (a checkpoint) is built in a hidden sibling and
  published with one rename (``staging_directory`` then ``replace_directory``).
- Object stores: one PUT per object (``pipe_file``). Streaming writes through
  ``fs.open(..., "wb")`` are never used: an exception inside such a block still completes
  a partial object. Large files go through s3fs's ``put_file``, which sends one PUT or a
  multipart upload that is completed only at the end and aborted on error.
- Listings: s3fs caches directory listings by default, which would hide new objects from
  a poller for good; ``open_filesystem`` turns that cache off for S3 and ``list_names`` /
  ``exists`` drop whatever a filesystem cached before asking.

Functions raise the backend's own exceptions (``OSError``, ``FileNotFoundError``, ...);
callers turn them into their own errors, naming their URL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

TEMP_PREFIX = ".tmp-"
"""Start of every temp file name; the leading dot keeps listings, human or code, from
mistaking a temp file for data."""

# Backends whose put_file never leaves a partial object (one PUT, or an aborted multipart).
_ATOMIC_PUT_FILE_PROTOCOLS = frozenset({"s3", "s3a"})
_COPY_CHUNK_BYTES = 8 * 1024 * 1024
S3_CLIENT_CONFIG: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 30,
    "retries": {"mode": "standard", "max_attempts": 4},
}
"""botocore settings of every S3 client: a throttled, failing or unreachable request is
retried with exponential backoff and jitter (`standard` mode; s3fs retries timeouts on
top), and a hung endpoint is given up on in minutes rather than the default's tens of
minutes, so an outage longer than the retries reaches the role (infra/outages.py)."""


def open_filesystem(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem behind ``url`` and the path inside it (bare paths are local files).

    For S3 the listings cache is off unless ``storage_options`` says otherwise: a poller
    must see objects committed after its first listing. botocore's timeouts and retries
    default to ``S3_CLIENT_CONFIG``; keys given in ``config_kwargs`` win.
    """
    options = dict(storage_options or {})
    if fsspec.utils.get_protocol(url) in ("s3", "s3a"):
        options.setdefault("use_listings_cache", False)
        options["config_kwargs"] = {**S3_CLIENT_CONFIG, **options.get("config_kwargs", {})}
    fs, path = url_to_fs(url, **options)
    return fs, path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local filesystem (paths are OS paths, rename is atomic)."""
    return isinstance(fs, LocalFileSystem)


def protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    """Every protocol name ``fs`` answers to (``("s3", "s3a")``, ``("memory",)``, ...)."""
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def url_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``path`` as an absolute, protocol-qualified URL (``file:///abs``, ``s3://b/k``)."""
    return str(fs.unstrip_protocol(path))


# --------------------------------------------------------------------------- writing


def put_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Make ``data`` visible at ``path`` all at once, or not at all, replacing any object.

    Local disks: temp file, fsync, rename, fsync of the directory (parents are created).
    Elsewhere: one PUT.
    """
    if is_local(fs):
        _write_local(path, lambda handle: handle.write(data))
    else:
        fs.pipe_file(path, data)


def put_file(fs: fsspec.AbstractFileSystem, source: str | Path, path: str) -> None:
    """Copy the local file ``source`` to ``path`` with the guarantees of ``put_atomic``.

    Unlike ``put_atomic`` the file is not read into memory on local disks and on S3
    (multi-GB weights); other object stores get one PUT of the whole file.
    """
    if is_local(fs):
        with open(source, "rb") as reader:
            _write_local(path, lambda handle: shutil.copyfileobj(reader, handle, _COPY_CHUNK_BYTES))
    elif _ATOMIC_PUT_FILE_PROTOCOLS.intersection(protocols(fs)):
        fs.put_file(os.fspath(source), path)
    else:
        fs.pipe_file(path, Path(source).read_bytes())


def link_file(fs: fsspec.AbstractFileSystem, source: str | Path, path: str) -> bool:
    """``put_file`` without copying, on a local disk: a hard link to ``source``, made
    durable (the source's bytes fsynced, then the link renamed in, then the directory
    fsynced). False, and nothing written, where no link can be made (another file
    system, another store); the caller copies then.

    For sources nobody rewrites in place: the link shares their bytes. The trainer's
    own freshly written versions qualify; a user's model folder does not.
    """
    if not is_local(fs):
        return False
    directory, temp = _temp_beside(path)
    try:
        os.link(source, temp)
    except OSError:  # EXDEV (another file system), EPERM (no links there), ...
        return False
    _rename_in(temp, path, directory, lambda: _fsync_file(os.fspath(source)))
    return True


def _write_local(path: str, write: Callable[[IO[bytes]], object]) -> None:
    directory, temp = _temp_beside(path)

    def fill() -> None:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            # Durable before visible: a power cut must not expose an empty file.
            os.fsync(handle.fileno())

    _rename_in(temp, path, directory, fill)


def _temp_beside(path: str) -> tuple[str, str]:
    """(`path`'s directory, made if missing; a fresh hidden temp name in it)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    return directory, os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}.part")


def _rename_in(temp: str, path: str, directory: str, prepare: Callable[[], None]) -> None:
    """`prepare` (fill `temp`, or make its bytes durable), then rename it onto `path` and
    fsync the directory; `temp` is removed if anything fails."""
    try:
        prepare()
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_directory(directory)


def fsync_directory(directory: str | Path) -> None:
    """Make renames and new entries in a local ``directory`` durable (best effort).

    Not every platform can open a directory; there the call does nothing.
    """
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def sweep_temps(directory: str, older_than_s: float) -> list[str]:
    """Delete temp files older than ``older_than_s`` in a local ``directory``; return them.

    Only writers that died mid-put leave temp files, and none is ever renamed later; the
    age guard spares the temp of a live writer sharing the directory.
    """
    cutoff = time.time() - older_than_s
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    removed = []
    for entry in entries:
        if entry.name.startswith(TEMP_PREFIX):
            with contextlib.suppress(OSError):
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed.append(entry.path)
    return removed


def rename(fs: fsspec.AbstractFileSystem, source: str, destination: str) -> None:
    """Move an object (one rename on local disks, copy then delete on object stores)."""
    if is_local(fs):
        os.makedirs(os.path.dirname(destination) or ".", exist_ok=True)
        os.replace(source, destination)
    else:
        fs.mv(source, destination)


# --------------------------------------------------------------------------- directories


@contextlib.contextmanager
def staging_directory(target: Path) -> Iterator[Path]:
    """A new, empty, hidden sibling of the local directory ``target`` to build it in.

    Publish it with ``replace_directory``; whatever is left of it on exit (an error, or
    a caller that decided not to publish) is deleted.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def replace_directory(staging: Path, target: Path) -> None:
    """Publish the local directory ``staging`` as ``target`` with one rename, durably.

    Every file and directory under ``staging`` is fsynced first, so a power cut never
    exposes a complete-looking directory with empty files. Whatever ``target`` held
    before (leftovers of a crash, a damaged copy) is moved aside and deleted.
    """
    for dirpath, _dirnames, filenames in os.walk(staging):
        for filename in filenames:
            _fsync_file(os.path.join(dirpath, filename))
        fsync_directory(dirpath)
    if target.exists():
        trash = target.parent / f".{target.name}.stale-{uuid.uuid4().hex[:8]}"
        os.rename(target, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(staging, target)
    fsync_directory(target.parent)


def _fsync_file(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# --------------------------------------------------------------------------- reading


def list_names(fs: fsspec.AbstractFileSystem, directory: str) -> list[str]:
    """Fresh listing of the base names in ``directory``; a missing directory is empty."""
    if is_local(fs):  # no per-entry stat: ~5x faster than fs.ls on a long stream
        try:
            return os.listdir(directory)
        except FileNotFoundError:
            return []
    fs.invalidate_cache(directory)
    try:
        paths = fs.ls(directory, detail=False)
    except FileNotFoundError:
        return []
    return [str(path).rstrip("/").rsplit("/", 1)[-1] for path in paths]


class StorageUnavailable(ConnectionError):
    """The run's storage cannot be reached, or refuses these credentials (one line)."""


PROBE_CLIENT_CONFIG: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 10,
    "retries": {"mode": "standard", "max_attempts": 2},
}
"""botocore settings of the one request that checks storage before a run starts: an
endpoint that does not answer is reported in seconds, not after the run's retries."""


def probe_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Check that `url`'s storage answers and accepts the credentials in the environment,
    with one listing of it; raise StorageUnavailable saying which of those failed."""
    options = dict(storage_options or {})
    if fsspec.utils.get_protocol(url) in ("s3", "s3a"):
        options["config_kwargs"] = {**PROBE_CLIENT_CONFIG, **options.get("config_kwargs", {})}
        options["skip_instance_cache"] = True  # the run's own filesystems keep their settings
    try:
        fs, path = open_filesystem(url, options)
        exists(fs, path)
    except Exception as exc:  # botocore's error types are a soft dependency here
        kind = type(exc).__name__
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else kind
        if kind == "NoCredentialsError":
            reason = (
                "no credentials were found: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for the run"
            )
        elif isinstance(exc, PermissionError):
            reason = f"access was refused with the credentials in the environment ({text})"
        elif isinstance(exc, OSError) or "Endpoint" in kind or "Connect" in kind:
            reason = f"nothing answered ({text})"
        else:
            reason = f"{kind}: {text}"
        raise StorageUnavailable(f"storage {url} cannot be used: {reason}") from None


def exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether ``path`` exists now (a cached listing is dropped first)."""
    fs.invalidate_cache(path)
    return bool(fs.exists(path))
