"""The local fetch cache of checkpoints: one verified copy per manifest digest.

`fetch_checkpoint` brings a committed checkpoint (``sluice.infra.checkpoints``) onto local disk
for a process to load. A remote checkpoint is downloaded into
``{cache_dir}/{manifest digest[:24]}``, every sha256 checked while streaming, and
renamed into place, so a worker that sees the same weights twice (the same version, or
two URLs with identical weights) downloads once. With ``keep_latest`` each fetch then
prunes the cache to the most recently fetched copies. With ``select`` only the files a
reader needs come down (the tokenizer without the weights, the policy without the
trainer state of an old checkpoint); the copy is keyed by the digest of that part.

The manifest is whatever the bucket holds, so a download trusts none of it: its names
are plain relative paths (checked when it is parsed), each file is written only inside
the staging folder (a planted link is refused), and its bytes land in a temporary file
that takes the file's name only once its size and sha256 match.

A copy in use is never pruned. The evaluate role, ``sluice eval`` and the time-to-target
benchmark share one evaluation cache, so without this one process's pruning could delete
the copy another process is still loading. The guard is an advisory lock (``flock``) on
each copy's directory:

- ``fetch_checkpoint`` returns its copy holding a *shared* lock on it, and this process
  keeps holding it until it next fetches from the same cache (or exits: the kernel drops
  a dead process's locks, so a killed role never pins a copy). A process therefore pins
  one copy per cache, the one it fetched last, which is the one it loads: every role
  fetches, then loads, one version at a time.
- Pruning deletes a copy only while holding the *exclusive* lock, asked for without
  waiting: a copy someone holds is skipped, and the cache stays over ``keep_latest``
  until its holder moves on.
- A fetcher whose copy is gone once its shared lock is granted (a pruner got there
  first) fetches again.

A grace period ("never prune a copy marked in the last N seconds") would be simpler but
not correct: nothing bounds how long loading takes, and it would stop a process from
pruning the copies it has itself just moved past. Locks are per open directory, not per
thread: threads of one process fetching from one cache at the same time are not
protected from each other (no Sluice process does that). On a filesystem without
``flock`` support the locks are skipped and pruning behaves as if no copy were in use.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sluice.infra.checkpoints import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointIncomplete,
    Manifest,
    check_file,
    hash_stream,
    open_checkpoint_fs,
    raise_missing,
    read_manifest,
    storage_errors,
    unsafe_name,
    verify_checkpoint,
)
from sluice.infra.storage import TEMP_PREFIX, is_local, replace_directory, staging_directory, url_of

# A copy pruned by another process between its download and our lock is fetched again;
# losing that race this many times in a row means something keeps deleting the cache.
_MAX_FETCH_ATTEMPTS = 5

# Resolved cache folder -> open descriptor of the copy this process holds (shared lock).
_held: dict[Path, int] = {}
_held_guard = threading.Lock()


def fetch_checkpoint(
    url: str,
    cache_dir: str | Path,
    storage_options: Mapping[str, Any] | None = None,
    *,
    keep_latest: int | None = None,
    select: Callable[[str], bool] | None = None,
) -> Path:
    """A verified local copy of the checkpoint at `url`; return its directory.

    A local URL is checked (manifest present, sizes match) and returned as is: no copy,
    and the cache is not touched. A remote checkpoint is downloaded into
    ``{cache_dir}/{manifest digest[:24]}`` with every sha256 checked while streaming, then
    renamed into place; if that directory is already there the download is skipped.
    `cache_dir` is therefore one cache for every version of a run: pass the same folder
    each time. The copy returned stays on disk at least until this process next fetches
    from `cache_dir` (see the module docstring). With `keep_latest` (>= 1) the cache is
    then pruned to that many most recently fetched copies, plus any copy another process
    still holds (`prune_checkpoint_cache`); the copy returned is never pruned.

    `select`, a predicate on file names ('/'-separated, relative to the checkpoint),
    fetches (and, for a local URL, checks) only the files it accepts; the copy's own
    manifest lists just those, and its folder is named by their digest. Nothing else of
    the checkpoint is read.
    """
    if keep_latest is not None and keep_latest < 1:
        raise CheckpointError(f"keep_latest must be >= 1 when fetching, got {keep_latest}")
    fs, path = open_checkpoint_fs(url, storage_options)
    if is_local(fs):
        verify_checkpoint(url, check_hashes=False, select=select)
        return Path(path)
    manifest = read_manifest(url, storage_options)
    if select is not None:
        manifest = manifest.model_copy(
            update={"files": tuple(e for e in manifest.files if select(e.name))}
        )
    cache_root = Path(cache_dir)
    target = cache_root / manifest.digest[:24]
    canonical = url_of(fs, path)
    for _attempt in range(_MAX_FETCH_ATTEMPTS):
        if not _cached_copy_is_valid(target, manifest):
            with staging_directory(target) as staging:
                with storage_errors(canonical, "download"):
                    _download_verified(fs, path, canonical, manifest, staging)
                # A concurrent fetcher may have won the race: keep its copy when it is valid.
                if not _cached_copy_is_valid(target, manifest):
                    replace_directory(staging, target)
        held = _hold(target, manifest)
        if held is not None:
            break
    else:
        raise CheckpointError(
            f"checkpoint {canonical!r}: its copy in {str(cache_root)!r} was deleted "
            f"{_MAX_FETCH_ATTEMPTS} times while it was being fetched; is something else "
            "cleaning that folder?"
        )
    # Most recently used: the last copy pruning removes (ns from the clock, not the
    # filesystem's coarser one, so fetches in quick succession stay ordered).
    now_ns = time.time_ns()
    os.utime(target, ns=(now_ns, now_ns))
    _hold_instead(cache_root, held)
    if keep_latest is not None:
        _prune(cache_root, keep_latest, newest=target)
    return target


def prune_checkpoint_cache(local_dir: str | Path, keep_latest: int) -> list[Path]:
    """Delete all but the `keep_latest` most recently fetched copies in a fetch cache.

    Returns the deleted directories. Only directories holding a Sluice manifest are
    touched, so pointing this at the wrong folder cannot wipe unrelated data; a copy a
    fetcher still holds (see the module docstring) is kept whatever its age.
    """
    if keep_latest < 0:
        raise CheckpointError(f"keep_latest must be >= 0, got {keep_latest}")
    return _prune(Path(local_dir), keep_latest, newest=None)


# ---------------------------------------------------------------- download


def _download_verified(fs: Any, path: str, url: str, manifest: Manifest, staging: Path) -> None:
    """Every file of `manifest` into `staging`, each hashed into a temporary file there
    and renamed to its name only once size and sha256 match: bytes that fail their hash
    never sit under a name a reader opens."""
    for entry in manifest.files:
        folder = _folder_inside(staging, entry.name, url)
        temp = folder / f"{TEMP_PREFIX}{uuid.uuid4().hex}.part"
        # O_EXCL | O_NOFOLLOW: never through a link planted under that name.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            with (
                fs.open(f"{path}/{entry.name}", "rb") as source,
                os.fdopen(os.open(temp, flags, 0o644), "wb") as sink,
            ):
                size, sha256 = hash_stream(source, sink)
            check_file(url, entry, size, sha256)
        except FileNotFoundError:
            temp.unlink(missing_ok=True)
            raise_missing(url, entry.name)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        # rename() replaces a link at the destination; it never writes through one.
        os.replace(temp, folder / entry.name.rsplit("/", 1)[-1])
    # Staged: the directory becomes visible, fsynced, only once this is written too.
    (staging / MANIFEST_NAME).write_bytes(manifest.to_json().encode())


def _folder_inside(staging: Path, name: str, url: str) -> Path:
    """The folder of file `name` under `staging`, made one real directory at a time.

    The manifest's names are checked when it is parsed; this is the second wall, against
    a link planted inside the staging folder: a part that exists as anything but a real
    directory is refused, and the folder found must resolve inside `staging`.
    """
    why = unsafe_name(name)
    if why:
        raise CheckpointIncomplete(f"checkpoint {url!r}: file name {name!r} {why}")
    folder = staging
    for part in name.split("/")[:-1]:
        folder = folder / part
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        if folder.is_symlink() or not folder.is_dir():
            raise CheckpointIncomplete(
                f"checkpoint {url!r}: {name!r} would be written through {str(folder)!r}, "
                "which is not a plain directory of the copy"
            )
    root = staging.resolve()
    if not folder.resolve().is_relative_to(root):
        raise CheckpointIncomplete(
            f"checkpoint {url!r}: {name!r} resolves outside the copy {str(root)!r}"
        )
    return folder


def _cached_copy_is_valid(target: Path, manifest: Manifest) -> bool:
    if not (target / MANIFEST_NAME).is_file():
        return False
    try:
        cached = Manifest.model_validate_json((target / MANIFEST_NAME).read_bytes())
    except (ValidationError, OSError):
        return False
    if cached.digest != manifest.digest:
        return False
    # Sizes only: the content was hashed when it was downloaded.
    try:
        return all(
            (target / e.name).is_file() and (target / e.name).stat().st_size == e.size_bytes
            for e in manifest.files
        )
    except FileNotFoundError:  # a pruner is deleting it
        return False


# ---------------------------------------------------------------- in use


def _lock(descriptor: int, operation: int) -> bool:
    """flock `descriptor`; False only when another holder refuses a non-blocking request."""
    try:
        fcntl.flock(descriptor, operation)
    except BlockingIOError:
        return False
    except OSError:
        pass  # no flock on this filesystem: no protection, as before locks existed
    return True


def _open_directory(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None


def _still_at(descriptor: int, path: Path) -> bool:
    """Whether `path` is still the directory `descriptor` was opened on (not deleted or
    replaced since)."""
    try:
        return os.path.samestat(os.fstat(descriptor), os.stat(path))
    except FileNotFoundError:
        return False


def _hold(target: Path, manifest: Manifest) -> int | None:
    """An open descriptor of the valid copy `target` under a shared lock, or None when
    the copy went away before the lock was granted."""
    descriptor = _open_directory(target)
    if descriptor is None:
        return None
    # Waits while a pruner holds the exclusive lock, that is while it deletes this copy.
    _lock(descriptor, fcntl.LOCK_SH)
    if _still_at(descriptor, target) and _cached_copy_is_valid(target, manifest):
        return descriptor
    os.close(descriptor)
    return None


def _hold_instead(cache_root: Path, descriptor: int) -> None:
    """Make `descriptor` the copy this process holds in `cache_root`; release the last one."""
    key = cache_root.resolve()
    with _held_guard:
        previous = _held.get(key)
        _held[key] = descriptor
    if previous is not None:
        os.close(previous)  # closing the descriptor releases its lock


def _delete_unless_held(copy: Path) -> bool:
    """Delete `copy` under the exclusive lock; False when a fetcher holds it (or it is gone)."""
    descriptor = _open_directory(copy)
    if descriptor is None:
        return False
    try:
        if not _lock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB):
            return False
        if not _still_at(descriptor, copy):
            return False
        shutil.rmtree(copy, ignore_errors=True)
        return True
    finally:
        os.close(descriptor)


def _fetched_at_ns(copy: Path) -> int:
    try:
        return copy.stat().st_mtime_ns
    except FileNotFoundError:  # another pruner deleted it meanwhile
        return -1


def _prune(root: Path, keep_latest: int, newest: Path | None) -> list[Path]:
    if not root.is_dir():
        return []
    copies = [
        child
        for child in root.iterdir()
        if child.is_dir() and not child.name.startswith(".") and (child / MANIFEST_NAME).is_file()
    ]
    # `newest` (the copy a fetch is about to return) first, whatever the clock says.
    copies.sort(key=lambda child: (child == newest, _fetched_at_ns(child)), reverse=True)
    return [child for child in copies[keep_latest:] if _delete_unless_held(child)]
