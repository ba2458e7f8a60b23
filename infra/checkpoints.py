"""Policy checkpoints on object storage: save, verify, read the manifest.

A Sluice checkpoint is a plain Hugging Face model directory (config.json, safetensors
shards, tokenizer files) stored under any fsspec URL (``file://``, a bare path, ``s3://``,
``memory://``), plus one extra file, ``sluice_manifest.json``, that lists every file with
its size in bytes and sha256. The manifest is written LAST and in one piece (a rename on
local disk, a single PUT on object stores), so its presence is what makes a checkpoint
durable and complete: the registry refuses to register a checkpoint whose manifest is
missing or whose files do not match it, and rollout workers never load a half-written one.

Departures from a plain ``save_pretrained``:

- On local disk the whole directory is written into a hidden sibling and renamed into
  place (``sluice.infra.storage.staging_directory``), so a crash leaves either nothing or a
  complete checkpoint at the final path. Object stores have no directory rename; there
  every file goes up all or nothing and the manifest-last rule marks completeness.
- Checkpoints are immutable: saving different content to a URL that already holds a
  complete checkpoint is an error, while saving the same content again is a no-op (so a
  trainer that crashed after uploading can simply retry).

Reading a checkpoint back onto local disk, through a digest-keyed cache, is
``sluice.infra.checkpoint_cache.fetch_checkpoint``; deleting one (retention) is
``delete_checkpoint``, manifest first, so a reader meets "incomplete", never a
checkpoint that looks whole with files missing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, NoReturn

from pydantic import ValidationError

from sluice.infra.checkpoint_manifest import (  # noqa: F401  (importable from here)
    MANIFEST_FORMAT,
    MANIFEST_FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    ManifestEntry,
    unsafe_name,
)
from sluice.infra.failpoints import failpoint
from sluice.infra.storage import (
    TEMP_PREFIX,
    is_local,
    link_file,
    open_filesystem,
    put_atomic,
    put_file,
    replace_directory,
    staging_directory,
    url_of,
)

# 8 MiB reads keep hashing at disk speed without holding a whole shard in memory.
_CHUNK_BYTES = 8 * 1024 * 1024
# Files hashed (and linked) at once: hashlib and fsync release the GIL, so a version's
# files (a policy shard, the optimizer state's parts) take about as long as the largest.
_PARALLEL_FILES = 8
# Temp files of sluice.infra.storage, and those older Sluice versions named after the manifest.
_TEMP_PREFIXES = (TEMP_PREFIX, f".{MANIFEST_NAME}.tmp-")


class CheckpointError(ValueError):
    """A checkpoint cannot be saved, read or loaded; the message names the URL or path."""


class CheckpointIncomplete(CheckpointError):
    """A checkpoint's manifest is missing or unreadable, or a file is missing, short or altered."""


# ---------------------------------------------------------------- URLs


def open_checkpoint_fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """The filesystem and path of a checkpoint URL; CheckpointError naming it when unusable."""
    if not isinstance(url, str) or not url:
        raise CheckpointError(f"checkpoint URL must be a non-empty string, got {url!r}")
    try:
        fs, path = open_filesystem(url, storage_options)
    except (ValueError, ImportError, OSError) as exc:
        raise CheckpointError(f"cannot open storage for checkpoint {url!r}: {exc}") from exc
    return fs, path.rstrip("/") or path


def canonical_url(url: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """`url` made absolute and protocol-qualified (``rel/dir`` -> ``file:///cwd/rel/dir``).

    The registry stores it, and readers in other processes (other working directories,
    other machines) must resolve it the same way.
    """
    fs, path = open_checkpoint_fs(url, storage_options)
    return url_of(fs, path)


class ForeignCheckpoint(CheckpointError):
    """A registered version names a checkpoint outside the run's own checkpoints."""


@functools.lru_cache(maxsize=64)
def _canonical_root(root: str, options_json: str, cwd: str) -> str:
    """`root` made canonical, once per root, options and working directory: every read of
    a run's registry checks its version's source against it."""
    return canonical_url(root, json.loads(options_json)).rstrip("/") + "/"


def check_source_within(
    source: str, root: str, storage_options: Mapping[str, Any] | None = None
) -> str:
    """`source`, a registered version's checkpoint URL, when it lies under `root` (the
    run's checkpoints); ForeignCheckpoint in one line otherwise.

    Whoever can write the MLflow registry can point a version anywhere (their own bucket,
    a local path with a planted model); a reader loads only what the run itself stores.
    The part under `root` must be plain names: no '..', '.', empty part, '::' (an fsspec
    chain) or backslash, so neither the OS nor fsspec can resolve it elsewhere.
    """
    options = json.dumps(dict(storage_options or {}), sort_keys=True, default=str)
    base = _canonical_root(root, options, os.getcwd())
    rest = source[len(base) :].rstrip("/") if source.startswith(base) else ""
    if not rest or "::" in rest or unsafe_name(rest):
        raise ForeignCheckpoint(
            f"refusing checkpoint {source!r}: it is not under the run's checkpoints {base!r} "
            "(a version is loaded only from where the run itself stores them)"
        )
    return source


@contextlib.contextmanager
def storage_errors(url: str, action: str) -> Iterator[None]:
    """Turn a storage OSError into a CheckpointError that names `url` and the `action`."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot {action} checkpoint at {url!r}: {exc}") from exc


# ---------------------------------------------------------------- manifest building


def _local_files(local_dir: Path) -> list[tuple[str, Path]]:
    """(relative posix name, absolute path) of every regular file, manifest excluded.

    Symlinks to files are followed: Hugging Face hub snapshots are directories of links.
    """
    found = []
    for dirpath, _dirnames, filenames in os.walk(local_dir, followlinks=True):
        for filename in filenames:
            full = Path(dirpath) / filename
            rel = full.relative_to(local_dir).as_posix()
            # Skip the manifest and any temp file an interrupted in-place seal left behind.
            if rel == MANIFEST_NAME or filename.startswith(_TEMP_PREFIXES):
                continue
            if not full.is_file():
                continue
            found.append((rel, full))
    return sorted(found)


def hash_stream(source: IO[bytes], sink: IO[bytes] | None = None) -> tuple[int, str]:
    """(bytes, hex sha256) of what is left in `source`, copied to `sink` on the way."""
    digest = hashlib.sha256()
    size = 0
    while chunk := source.read(_CHUNK_BYTES):
        if sink is not None:
            sink.write(chunk)
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def _hash_file(path: Path, name: str) -> ManifestEntry:
    with open(path, "rb") as handle:
        size, sha256 = hash_stream(handle)
    return ManifestEntry(name=name, size_bytes=size, sha256=sha256)


def _source_files(local_dir: Path) -> list[tuple[str, Path]]:
    if not local_dir.is_dir():
        raise CheckpointError(f"checkpoint source {str(local_dir)!r} is not a directory")
    files = _local_files(local_dir)
    if not files:
        raise CheckpointError(f"checkpoint source {str(local_dir)!r} holds no files")
    return files


def _each_file(
    work: Callable[[tuple[str, Path]], Any], files: list[tuple[str, Path]]
) -> Iterator[Any]:
    """`work` on every file, several at a time; results in the order of `files`, the
    first error raised once every started file has finished."""
    workers = min(len(files), _PARALLEL_FILES, os.cpu_count() or 1)
    if workers <= 1:
        yield from map(work, files)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-file") as pool:
        yield from pool.map(work, files)


def _manifest_of(files: list[tuple[str, Path]], metadata: Mapping[str, Any] | None) -> Manifest:
    entries = list(_each_file(lambda file: _hash_file(file[1], file[0]), files))
    return Manifest(
        created_at_unix_s=time.time(),
        files=tuple(entries),
        metadata={str(k): str(v) for k, v in (metadata or {}).items()},
    )


def _parse_manifest(raw: bytes, url: str) -> Manifest:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointIncomplete(
            f"checkpoint {url!r}: {MANIFEST_NAME} is not JSON ({exc})"
        ) from exc
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise CheckpointIncomplete(f"checkpoint {url!r}: {MANIFEST_NAME} is not a Sluice manifest")
    if data.get("format_version") != MANIFEST_FORMAT_VERSION:
        raise CheckpointIncomplete(
            f"checkpoint {url!r}: manifest format_version {data.get('format_version')!r} "
            f"is not supported (expected {MANIFEST_FORMAT_VERSION})"
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CheckpointIncomplete(
            f"checkpoint {url!r}: malformed {MANIFEST_NAME} at '{where}': "
            f"{first['msg'].removeprefix('Value error, ')}"
        ) from exc


def read_manifest(url: str, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest of the checkpoint at `url`; CheckpointIncomplete when there is none."""
    fs, path = open_checkpoint_fs(url, storage_options)
    manifest_path = f"{path}/{MANIFEST_NAME}"
    with storage_errors(url, "read"):
        try:
            raw = fs.cat_file(manifest_path)
        except FileNotFoundError:
            raise CheckpointIncomplete(
                f"checkpoint {url!r} is incomplete: no {MANIFEST_NAME} (the upload did not "
                "finish, or this is not a Sluice checkpoint)"
            ) from None
    return _parse_manifest(raw, url)


# ---------------------------------------------------------------- verify


def verify_checkpoint(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    check_hashes: bool = True,
    select: Callable[[str], bool] | None = None,
) -> Manifest:
    """Check that the checkpoint at `url` is complete; return its manifest.

    Raises CheckpointIncomplete naming the URL and the first offending file when the
    manifest is missing or unreadable, or a listed file is missing, has the wrong size,
    or (with `check_hashes`) different content. `check_hashes=False` checks presence and
    sizes only: one metadata request per file instead of reading every byte back, which
    is what matters for multi-GB checkpoints on S3 (truncation still shows as a short file).
    `select` (a predicate on file names) checks only the files it accepts: a reader that
    needs the tokenizer is not stopped by a damaged weight file it never opens.
    """
    manifest = read_manifest(url, storage_options)
    fs, path = open_checkpoint_fs(url, storage_options)
    with storage_errors(url, "verify"):
        for entry in manifest.files:
            if select is not None and not select(entry.name):
                continue
            file_path = f"{path}/{entry.name}"
            try:
                size = int(fs.info(file_path)["size"])
            except FileNotFoundError:
                raise_missing(url, entry.name)
            check_file(url, entry, size)
            if not check_hashes:
                continue
            with fs.open(file_path, "rb") as handle:
                _size, sha256 = hash_stream(handle)
            check_file(url, entry, size, sha256)
    return manifest


def raise_missing(url: str, name: str) -> NoReturn:
    raise CheckpointIncomplete(f"checkpoint {url!r} is incomplete: {name} is missing") from None


def check_file(url: str, entry: ManifestEntry, size: int, sha256: str | None = None) -> None:
    """One file of checkpoint `url` against its manifest entry (the hash only when given)."""
    if size != entry.size_bytes:
        raise CheckpointIncomplete(
            f"checkpoint {url!r} is incomplete: {entry.name} has {size} bytes, "
            f"manifest says {entry.size_bytes}"
        )
    if sha256 is not None and sha256 != entry.sha256:
        raise CheckpointIncomplete(
            f"checkpoint {url!r} is corrupt: {entry.name} does not match its sha256"
        )


# ---------------------------------------------------------------- save


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _put_files(
    fs: Any,
    root: str,
    files: list[tuple[str, Path]],
    stamps: list[tuple[int, int]],
    link: bool = False,
) -> None:
    """Upload every file under `root`, each all or nothing, then check none changed;
    with `link`, hard-link each where the store allows it (`link_file`) instead.

    `stamps` are (size, mtime) taken before the files were hashed: a file written to
    while it was hashed or uploaded would not match its manifest entry. Links (each an
    fsync of its source) are made several at a time; uploads and copies one by one.
    """

    def put(file: tuple[str, Path]) -> None:
        rel, full = file
        failpoint("checkpoint.put_file")  # armed to sleep: slow storage on purpose
        if not (link and link_file(fs, full, f"{root}/{rel}")):
            put_file(fs, full, f"{root}/{rel}")

    done = _each_file(put, files) if link else map(put, files)
    for index, _ in enumerate(done):
        if index == 0:
            failpoint("checkpoint.mid_upload")
    for (_rel, full), stamp in zip(files, stamps, strict=True):
        if _stamp(full) != stamp:
            raise CheckpointError(
                f"{str(full)!r} changed while it was being uploaded; save the checkpoint again "
                "once the writer has finished"
            )


def _save_remote(
    fs: Any,
    path: str,
    manifest: Manifest,
    files: list[tuple[str, Path]],
    stamps: list[tuple[int, int]],
) -> None:
    manifest_path = f"{path}/{MANIFEST_NAME}"
    # A manifest here belongs to a damaged copy of the same weights: withdraw it first so no
    # reader trusts the files while they are being replaced.
    if fs.exists(manifest_path):
        fs.rm_file(manifest_path)
    # Files of an earlier, interrupted upload that the new manifest does not list.
    wanted = {f"{path}/{entry.name}" for entry in manifest.files}
    for leftover in fs.find(path) if fs.exists(path) else []:
        if leftover not in wanted:
            fs.rm_file(leftover)
    _put_files(fs, path, files, stamps)
    # The manifest goes last, in a single PUT: until it lands, readers see "incomplete".
    put_atomic(fs, manifest_path, manifest.to_json().encode())


def save_checkpoint(
    local_dir: str | Path,
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
    replace: bool = False,
    link: bool = False,
) -> str:
    """Upload the Hugging Face directory `local_dir` to `url`; return the canonical URL.

    The manifest is written last; on local disk the directory appears atomically. If
    `url` is `local_dir` itself the directory is sealed in place (only the manifest is
    written). Saving identical content again returns at once; different content at a URL
    that already holds a complete checkpoint raises CheckpointError (checkpoints are
    immutable), unless `replace`: then that checkpoint is deleted first. Pass it only for
    a URL no committed version refers to (the leftover of an attempt that died before
    its commit). `metadata` (e.g. policy version) is stored in the manifest as strings.

    The returned URL is absolute and protocol-qualified (``file:///abs/path``,
    ``s3://bucket/key``, ``memory:///key``), ready to be registered.

    `link`: on a local disk, hard-link the files instead of copying them where the file
    system allows it, for a `local_dir` that nothing rewrites in place afterwards (the
    trainer's own versions: it writes each into a fresh folder). Halves the bytes a
    version writes and skips reading them back.
    """
    source = Path(local_dir)
    fs, path = open_checkpoint_fs(url, storage_options)
    canonical = url_of(fs, path)
    files = _source_files(source)
    stamps = [_stamp(full) for _rel, full in files]
    manifest = _manifest_of(files, metadata)
    try:
        existing: Manifest | None = read_manifest(url, storage_options)
    except CheckpointIncomplete:
        existing = None
    if existing is not None and existing.digest != manifest.digest and replace:
        delete_checkpoint(url, storage_options)
        existing = None
    if existing is not None:
        if existing.digest != manifest.digest:
            raise CheckpointError(
                f"checkpoint {canonical!r} already exists with different content "
                f"(digest {existing.digest[:12]} != {manifest.digest[:12]}); committed "
                "checkpoints are immutable, save to a new policy version instead"
            )
        try:
            verify_checkpoint(url, storage_options, check_hashes=False)
            return canonical
        except CheckpointIncomplete:
            pass  # same manifest but damaged files: upload again below
    manifest_bytes = manifest.to_json().encode()
    with storage_errors(canonical, "write"):
        if not is_local(fs):
            _save_remote(fs, path, manifest, files, stamps)
        elif Path(path).resolve() == source.resolve():
            put_atomic(fs, f"{path}/{MANIFEST_NAME}", manifest_bytes)
        else:
            with staging_directory(Path(path)) as staging:
                _put_files(fs, str(staging), files, stamps, link=link)
                put_atomic(fs, f"{staging}/{MANIFEST_NAME}", manifest_bytes)
                # Leftovers without a valid manifest, or a damaged copy of these same
                # weights, are moved aside so the rename can land.
                replace_directory(staging, Path(path))
    return canonical


# ---------------------------------------------------------------- delete


def delete_checkpoint(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Delete the checkpoint at `url`, manifest first; False when there was nothing there.

    With the manifest gone first, a reader that races the deletion gets
    CheckpointIncomplete for the whole checkpoint instead of a "complete" one with files
    missing, and a deletion that fails half way leaves an incomplete checkpoint that the
    next call removes. Raises CheckpointError naming the URL when storage refuses.
    """
    fs, path = open_checkpoint_fs(url, storage_options)
    with storage_errors(url, "delete"):
        fs.invalidate_cache(path)
        if not fs.exists(path):
            return False
        manifest_path = f"{path}/{MANIFEST_NAME}"
        if fs.exists(manifest_path):
            fs.rm_file(manifest_path)
        # Object stores have no directories: the prefix is gone once its objects are.
        fs.rm(path, recursive=True)
        return True
