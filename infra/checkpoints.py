"""Policy checkpoints on object storage: upload, verify, fetch, load.

A Sluice checkpoint is a plain Hugging Face model directory (config.json, safetensors
shards, tokenizer files) stored under any fsspec URL (``file://``, a bare path, ``s3://``,
``memory://``), plus one extra file, ``sluice_manifest.json``, that lists every file with
its size in bytes and sha256. The manifest is written LAST and in one piece (a rename on
local disk, a single PUT on object stores), so its presence is what makes a checkpoint
durable and complete: the registry refuses to register a checkpoint whose manifest is
missing or whose files do not match it, and rollout workers never load a half-written one.

Departures from a plain ``save_pretrained``:

- On local disk the whole directory is written into a hidden sibling and renamed into
  place, so a crash leaves either nothing or a complete checkpoint at the final path.
  Object stores have no directory rename; there the manifest-last rule alone marks
  completeness.
- Checkpoints are immutable: saving different content to a URL that already holds a
  complete checkpoint is an error, while saving the same content again is a no-op (so a
  trainer that crashed after uploading can simply retry).
- ``fetch_checkpoint`` caches by manifest digest, so a worker that sees the same version
  twice (or two URLs with identical weights) downloads once.

``load_policy`` accepts ANY local Hugging Face causal-LM directory, manifest or not: a
user-provided model needs no Sluice bookkeeping. Only remote URLs go through the
manifest-checked fetch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:  # torch/transformers are heavy: imported only inside load_policy
    import torch

MANIFEST_NAME = "sluice_manifest.json"
MANIFEST_FORMAT = "sluice-checkpoint"
MANIFEST_FORMAT_VERSION = 1
# 8 MiB reads keep hashing at disk speed without holding a whole shard in memory.
_CHUNK_BYTES = 8 * 1024 * 1024
_DTYPES = ("float32", "bfloat16", "float16", "auto")


class CheckpointError(ValueError):
    """A checkpoint cannot be saved, read or loaded; the message names the URL or path."""


class CheckpointIncomplete(CheckpointError):
    """A checkpoint's manifest is missing or unreadable, or a file is missing, short or altered."""


class ManifestEntry(BaseModel):
    """One file of a checkpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """Path relative to the checkpoint root, '/'-separated (e.g. 'model.safetensors')."""
    size_bytes: int = Field(ge=0)
    """Exact file size in bytes; a shorter file means an interrupted upload."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex sha256 of the file content."""


class Manifest(BaseModel):
    """The completeness record of a checkpoint (``sluice_manifest.json``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    format: str = MANIFEST_FORMAT
    """Always 'sluice-checkpoint'; lets a reader reject unrelated JSON files."""
    format_version: int = MANIFEST_FORMAT_VERSION
    """Manifest schema version; readers refuse versions they do not know."""
    created_at_unix_s: float
    """Wall-clock time the manifest was written (seconds since the epoch)."""
    files: tuple[ManifestEntry, ...]
    """Every file of the checkpoint except the manifest itself, sorted by name."""
    metadata: dict[str, str] = {}
    """Free-form provenance (policy version, trainer step, ...); not part of the digest."""

    @property
    def total_bytes(self) -> int:
        """Sum of all file sizes in bytes."""
        return sum(entry.size_bytes for entry in self.files)

    @property
    def digest(self) -> str:
        """sha256 over (name, size, sha256) of every file: equal digests mean identical weights.

        Metadata and creation time are left out, so re-saving the same weights gives the
        same digest (that is what makes save retries idempotent and the fetch cache hit).
        """
        canonical = json.dumps(
            [[e.name, e.size_bytes, e.sha256] for e in self.files], separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_json(self) -> str:
        """Serialised manifest, pretty-printed so a human can read it on the bucket."""
        return self.model_dump_json(indent=2)


# ---------------------------------------------------------------- URLs


def checkpoint_url(root: str, run: str, policy_version: int) -> str:
    """Canonical location of policy version `policy_version` of `run` under storage `root`.

    Layout: ``{root}/{run}/checkpoints/v{policy_version:06d}`` (zero-padded so a plain
    listing sorts in version order).
    """
    if not root:
        raise CheckpointError("checkpoint root URL is empty")
    if not run or "/" in run or run in (".", ".."):
        raise CheckpointError(f"run name {run!r} must be a non-empty single path component")
    if (
        isinstance(policy_version, bool)
        or not isinstance(policy_version, int)
        or policy_version < 0
    ):
        raise CheckpointError(f"policy_version must be an int >= 0, got {policy_version!r}")
    return f"{root.rstrip('/')}/{run}/checkpoints/v{policy_version:06d}"


def _open_fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    if not isinstance(url, str) or not url:
        raise CheckpointError(f"checkpoint URL must be a non-empty string, got {url!r}")
    try:
        fs, path = url_to_fs(url, **dict(storage_options or {}))
    except (ValueError, ImportError, OSError) as exc:
        raise CheckpointError(f"cannot open storage for checkpoint {url!r}: {exc}") from exc
    return fs, path.rstrip("/") or path


def is_local_url(url: str) -> bool:
    """True when `url` (bare path, ``file://`` or ``local://``) names the local filesystem."""
    fs, _ = _open_fs(url, None)
    return isinstance(fs, LocalFileSystem)


def _canonical_url(fs: Any, path: str) -> str:
    # An absolute, protocol-qualified URL: the registry stores it, and readers in other
    # processes (other working directories, other machines) must resolve it the same way.
    return str(fs.unstrip_protocol(path))


def canonical_url(url: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """`url` made absolute and protocol-qualified (``rel/dir`` -> ``file:///cwd/rel/dir``)."""
    fs, path = _open_fs(url, storage_options)
    return _canonical_url(fs, path)


@contextlib.contextmanager
def _storage_errors(url: str, action: str) -> Iterator[None]:
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
            if rel == MANIFEST_NAME or filename.startswith(f".{MANIFEST_NAME}.tmp-"):
                continue
            if not full.is_file():
                continue
            found.append((rel, full))
    return sorted(found)


def _hash_file(path: Path, name: str) -> ManifestEntry:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return ManifestEntry(name=name, size_bytes=size, sha256=digest.hexdigest())


def build_manifest(local_dir: str | Path, metadata: Mapping[str, Any] | None = None) -> Manifest:
    """Hash every file of a local checkpoint directory into a Manifest (nothing is written)."""
    root = Path(local_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint source {str(root)!r} is not a directory")
    files = _local_files(root)
    if not files:
        raise CheckpointError(f"checkpoint source {str(root)!r} holds no files")
    entries = [_hash_file(full, rel) for rel, full in files]
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
            f"checkpoint {url!r}: malformed {MANIFEST_NAME} at '{where}': {first['msg']}"
        ) from exc


def read_manifest(url: str, storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest of the checkpoint at `url`; CheckpointIncomplete when there is none."""
    fs, path = _open_fs(url, storage_options)
    manifest_path = f"{path}/{MANIFEST_NAME}"
    with _storage_errors(url, "read"):
        try:
            raw = fs.cat_file(manifest_path)
        except FileNotFoundError:
            raise CheckpointIncomplete(
                f"checkpoint {url!r} is incomplete: no {MANIFEST_NAME} (the upload did not "
                "finish, or this is not a Sluice checkpoint)"
            ) from None
    return _parse_manifest(raw, url)


# ---------------------------------------------------------------- verify


def _sha256_remote(fs: Any, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def verify_checkpoint(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    check_hashes: bool = True,
) -> Manifest:
    """Check that the checkpoint at `url` is complete; return its manifest.

    Raises CheckpointIncomplete naming the URL and the first offending file when the
    manifest is missing or unreadable, or a listed file is missing, has the wrong size,
    or (with `check_hashes`) different content. `check_hashes=False` checks presence and
    sizes only: one metadata request per file instead of reading every byte back, which
    is what matters for multi-GB checkpoints on S3 (truncation still shows as a short file).
    """
    manifest = read_manifest(url, storage_options)
    fs, path = _open_fs(url, storage_options)
    with _storage_errors(url, "verify"):
        for entry in manifest.files:
            file_path = f"{path}/{entry.name}"
            try:
                size = int(fs.info(file_path)["size"])
            except FileNotFoundError:
                raise CheckpointIncomplete(
                    f"checkpoint {url!r} is incomplete: {entry.name} is missing"
                ) from None
            if size != entry.size_bytes:
                raise CheckpointIncomplete(
                    f"checkpoint {url!r} is incomplete: {entry.name} has {size} bytes, "
                    f"manifest says {entry.size_bytes}"
                )
            if check_hashes and _sha256_remote(fs, file_path) != entry.sha256:
                raise CheckpointIncomplete(
                    f"checkpoint {url!r} is corrupt: {entry.name} does not match its sha256"
                )
    return manifest


def _existing_manifest(url: str, storage_options: Mapping[str, Any] | None) -> Manifest | None:
    try:
        return read_manifest(url, storage_options)
    except CheckpointIncomplete:
        return None


# ---------------------------------------------------------------- save


def _fsync_dir(path: Path) -> None:
    # The rename that publishes a checkpoint is only durable once its directory entry is.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_local_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _copy_hashing(source: Path, sink: Any) -> tuple[int, str]:
    """Stream `source` into the open binary `sink`; return (bytes, sha256) of what was sent."""
    digest = hashlib.sha256()
    size = 0
    with open(source, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            sink.write(chunk)
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _check_unchanged(entry: ManifestEntry, sent: tuple[int, str], source: Path) -> None:
    if sent != (entry.size_bytes, entry.sha256):
        raise CheckpointError(
            f"{str(source)!r} changed while it was being uploaded; save the checkpoint again "
            "once the writer has finished"
        )


def _save_local(
    source: Path, target: Path, manifest: Manifest, files: list[tuple[str, Path]]
) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        for entry, (_rel, full) in zip(manifest.files, files, strict=True):
            dest = staging / entry.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "wb") as sink:
                sent = _copy_hashing(full, sink)
                sink.flush()
                os.fsync(sink.fileno())
            _check_unchanged(entry, sent, full)
        _write_local_atomic(staging / MANIFEST_NAME, manifest.to_json().encode())
        if target.exists():
            # Leftovers without a valid manifest, or a damaged copy of these same weights:
            # move them aside so the rename can land.
            trash = target.parent / f".{target.name}.stale-{uuid.uuid4().hex[:8]}"
            os.rename(target, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(staging, target)
        _fsync_dir(target.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _save_remote(fs: Any, path: str, manifest: Manifest, files: list[tuple[str, Path]]) -> None:
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
    for entry, (_rel, full) in zip(manifest.files, files, strict=True):
        with fs.open(f"{path}/{entry.name}", "wb") as sink:
            sent = _copy_hashing(full, sink)
        _check_unchanged(entry, sent, full)
    # The manifest goes last, in a single PUT: until it lands, readers see "incomplete".
    fs.pipe_file(manifest_path, manifest.to_json().encode())


def save_checkpoint(
    local_dir: str | Path,
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """Upload the Hugging Face directory `local_dir` to `url`; return the canonical URL.

    The manifest is written last; on local disk the directory appears atomically. If
    `url` is `local_dir` itself the directory is sealed in place (only the manifest is
    written). Saving identical content again returns at once; different content at a URL
    that already holds a complete checkpoint raises CheckpointError (checkpoints are
    immutable). `metadata` (e.g. policy version) is stored in the manifest as strings.

    The returned URL is absolute and protocol-qualified (``file:///abs/path``,
    ``s3://bucket/key``, ``memory:///key``), ready to be registered.
    """
    source = Path(local_dir)
    fs, path = _open_fs(url, storage_options)
    canonical = _canonical_url(fs, path)
    manifest = build_manifest(source, metadata)
    files = _local_files(source)
    existing = _existing_manifest(url, storage_options)
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
    with _storage_errors(canonical, "write"):
        if isinstance(fs, LocalFileSystem):
            target = Path(path)
            if target.resolve() == source.resolve():
                _write_local_atomic(target / MANIFEST_NAME, manifest.to_json().encode())
                _fsync_dir(target)
            else:
                _save_local(source, target, manifest, files)
        else:
            _save_remote(fs, path, manifest, files)
    return canonical


# ---------------------------------------------------------------- fetch


def _download_verified(fs: Any, path: str, url: str, manifest: Manifest, staging: Path) -> None:
    for entry in manifest.files:
        dest = staging / entry.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        try:
            with fs.open(f"{path}/{entry.name}", "rb") as source, open(dest, "wb") as sink:
                while chunk := source.read(_CHUNK_BYTES):
                    sink.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
        except FileNotFoundError:
            raise CheckpointIncomplete(
                f"checkpoint {url!r} is incomplete: {entry.name} is missing"
            ) from None
        if size != entry.size_bytes:
            raise CheckpointIncomplete(
                f"checkpoint {url!r} is incomplete: {entry.name} has {size} bytes, "
                f"manifest says {entry.size_bytes}"
            )
        if digest.hexdigest() != entry.sha256:
            raise CheckpointIncomplete(
                f"checkpoint {url!r} is corrupt: {entry.name} does not match its sha256"
            )
    _write_local_atomic(staging / MANIFEST_NAME, manifest.to_json().encode())


def fetch_checkpoint(
    url: str,
    local_dir: str | Path,
    storage_options: Mapping[str, Any] | None = None,
) -> Path:
    """A verified local copy of the checkpoint at `url`; return its directory.

    A local URL is checked (manifest present, sizes match) and returned as is: no copy.
    A remote checkpoint is downloaded into ``{local_dir}/{manifest digest[:24]}`` with
    every sha256 checked while streaming, then renamed into place; if that directory is
    already there the download is skipped. `local_dir` is therefore a cache shared by
    all versions (see `prune_checkpoint_cache`).
    """
    fs, path = _open_fs(url, storage_options)
    if isinstance(fs, LocalFileSystem):
        verify_checkpoint(url, check_hashes=False)
        return Path(path)
    manifest = read_manifest(url, storage_options)
    cache_root = Path(local_dir)
    target = cache_root / manifest.digest[:24]
    if _cached_copy_is_valid(target, manifest):
        os.utime(target)  # mark as recently used for prune_checkpoint_cache
        return target
    canonical = _canonical_url(fs, path)
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = cache_root / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        with _storage_errors(canonical, "download"):
            _download_verified(fs, path, canonical, manifest, staging)
        if target.exists():
            # A concurrent fetcher won the race or an old copy is damaged: keep a valid one.
            if _cached_copy_is_valid(target, manifest):
                return target
            trash = cache_root / f".{target.name}.stale-{uuid.uuid4().hex[:8]}"
            os.rename(target, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(staging, target)
        _fsync_dir(cache_root)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _cached_copy_is_valid(target: Path, manifest: Manifest) -> bool:
    if not (target / MANIFEST_NAME).is_file():
        return False
    try:
        cached = Manifest.model_validate_json((target / MANIFEST_NAME).read_bytes())
    except ValidationError:
        return False
    if cached.digest != manifest.digest:
        return False
    # Sizes only: the content was hashed when it was downloaded.
    return all(
        (target / e.name).is_file() and (target / e.name).stat().st_size == e.size_bytes
        for e in manifest.files
    )


def prune_checkpoint_cache(local_dir: str | Path, keep_latest: int) -> list[Path]:
    """Delete all but the `keep_latest` most recently fetched copies in a fetch cache.

    Returns the deleted directories. Only directories holding a Sluice manifest are
    touched, so pointing this at the wrong folder cannot wipe unrelated data.
    """
    if keep_latest < 0:
        raise CheckpointError(f"keep_latest must be >= 0, got {keep_latest}")
    root = Path(local_dir)
    if not root.is_dir():
        return []
    copies = [
        child
        for child in root.iterdir()
        if child.is_dir() and not child.name.startswith(".") and (child / MANIFEST_NAME).is_file()
    ]
    copies.sort(key=lambda child: child.stat().st_mtime, reverse=True)
    removed = copies[keep_latest:]
    for child in removed:
        shutil.rmtree(child, ignore_errors=True)
    return removed


# ---------------------------------------------------------------- load


def load_policy(
    path_or_url: str | Path,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    *,
    cache_dir: str | Path = ".sluice/checkpoint_cache",
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[Any, Any]:
    """Load (model, tokenizer) from a Hugging Face causal-LM directory or checkpoint URL.

    A local directory (bare path or ``file://``) is loaded directly and needs no Sluice
    manifest, so any user-provided model works. A remote URL is first fetched into
    `cache_dir` and verified against its manifest. `dtype` is 'float32', 'bfloat16',
    'float16', 'auto' (as saved) or a torch.dtype. The model is returned in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
        torch_dtype: Any = dtype if dtype == "auto" else getattr(torch, dtype)
    else:
        torch_dtype = dtype
    url = str(path_or_url)
    fs, path = _open_fs(url, storage_options)
    if isinstance(fs, LocalFileSystem):
        model_dir = Path(path)
    else:
        model_dir = fetch_checkpoint(url, cache_dir, storage_options)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {str(model_dir)!r} does not exist")
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(
            f"{str(model_dir)!r} is not a Hugging Face model directory (no config.json)"
        )
    try:
        # Typed as Any: transformers' stubs for .to() reject a device string.
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot load a causal LM from {str(model_dir)!r}: {exc}") from exc
    model.to(device)
    model.eval()
    return model, tokenizer
