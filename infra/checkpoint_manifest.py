"""The manifest of a Sluice checkpoint (``sluice_manifest.json``): every file with its
size and sha256, and the rule a file name must obey.

Readers write each listed file under their own copy of the checkpoint, so the names are
checked where the manifest is parsed: a hostile manifest is refused in one line before
any byte is written (``sluice.infra.checkpoint_cache`` checks the destination again).
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field, field_validator

MANIFEST_NAME = "sluice_manifest.json"
MANIFEST_FORMAT = "sluice-checkpoint"
MANIFEST_FORMAT_VERSION = 1


class ManifestEntry(BaseModel):
    """One file of a checkpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """Path relative to the checkpoint root, '/'-separated (e.g. 'model.safetensors')."""
    size_bytes: int = Field(ge=0)
    """Exact file size in bytes; a shorter file means an interrupted upload."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex sha256 of the file content."""

    @field_validator("name")
    @classmethod
    def _stays_inside(cls, name: str) -> str:
        # A reader writes each file at `<its copy>/<name>`: whoever can write the bucket
        # (or register a version pointing at their own) must not place a file elsewhere.
        why = unsafe_name(name)
        if why:
            raise ValueError(f"file name {name!r} {why}; a manifest lists relative paths only")
        return name


def unsafe_name(name: str) -> str | None:
    """Why `name` cannot be a file of a checkpoint (None when it can): a relative POSIX
    path of non-empty parts, none of them '.' or '..', without backslash or NUL."""
    if "\x00" in name:
        return "holds a NUL byte"
    if "\\" in name:
        return "holds a backslash"
    if name.startswith("/"):
        return "is absolute"
    parts = name.split("/")
    if "" in parts:
        return "has an empty part"
    if ".." in parts or "." in parts:
        return "climbs out with '..' or '.'"
    return None


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
