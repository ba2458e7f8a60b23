"""The shard-name grammar: how a stream's files are named, and ``ShardRef``, a parsed name.

A shard is ``{commit_ns:020d}-{writer_id}-{tag}-g{groups}-r{rows}.arrow``:

- the zero-padded commit time in nanoseconds comes first, so a listing sorted by name is
  commit order (invariant 3, oldest first);
- the tag is ``s{sequence:08d}`` for a plain write, or ``k`` + 20 hex digits of the
  sha256 of a ``shard_key`` for an idempotent one (``shard_key_tag``);
- the group and row counts let a trainer tell from one listing whether a batch is ready
  without opening a single shard.

Names that do not match (notes, temp files, ``_ledger/``, ``_quarantine/``) are never
offered as shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sluice.infra.streams.errors import StreamConfigError

SHARD_SUFFIX = ".arrow"
QUARANTINE_DIR = "_quarantine"
LEDGER_DIR = "_ledger"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Greedy writer id: the tag, group and row fields are always the last three.
_SHARD_RE = re.compile(
    r"^(?P<ns>\d{20})-(?P<writer>[A-Za-z0-9][A-Za-z0-9._-]*)-(?P<tag>s\d{8,}|k[0-9a-f]{20})"
    r"-g(?P<groups>\d+)-r(?P<rows>\d+)\.arrow$"
)


def check_name(kind: str, value: str) -> str:
    """``value`` when it can name a run, stream, writer or consumer; else StreamConfigError."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise StreamConfigError(
            f"{kind} {value!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def shard_name(commit_ns: int, writer_id: str, tag: str, num_groups: int, num_rows: int) -> str:
    """The file name of a shard committed at ``commit_ns`` (see the module docstring)."""
    return f"{commit_ns:020d}-{writer_id}-{tag}-g{num_groups}-r{num_rows}{SHARD_SUFFIX}"


def is_shard_name(name: str) -> bool:
    """Whether ``name`` follows the shard-name grammar."""
    return _SHARD_RE.match(name) is not None


def sequence_tag(sequence: int) -> str:
    """The tag of a writer's ``sequence``-th plain (unkeyed) shard."""
    return f"s{sequence:08d}"


def shard_key_tag(shard_key: str) -> str:
    """The tag a shard written with ``shard_key`` carries in its name (``ShardRef.tag``)."""
    return "k" + hashlib.sha256(shard_key.encode()).hexdigest()[:20]


def tag_of(name: str) -> str | None:
    """The tag of a shard name, None when ``name`` is not one."""
    match = _SHARD_RE.match(name)
    return match["tag"] if match else None


def names_of(refs: Iterable[ShardRef | str]) -> Iterator[str]:
    """Shard names of refs, names or URLs (a single ref or name is refused, not iterated)."""
    if isinstance(refs, (ShardRef, str)):
        raise TypeError("pass a list of ShardRef or shard names, not a single one")
    for ref in refs:
        yield ref.name if isinstance(ref, ShardRef) else str(ref).rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True, order=True)
class ShardRef:
    """A committed shard: small, serialisable, what tasks pass around instead of data.

    Refs sort by ``name``, which is commit order.
    """

    name: str
    """File name inside the stream prefix; unique, sorts in commit order."""
    url: str = field(compare=True)
    """Full fsspec URL of the shard."""
    commit_time_ns: int = field(compare=False)
    """Writer wall-clock time of the commit, ns since the epoch."""
    writer_id: str = field(compare=False)
    """Id of the writer that committed it."""
    num_groups: int = field(compare=False)
    """Distinct prompt groups in the shard."""
    num_rows: int = field(compare=False)
    """Rows (sampled responses) in the shard."""
    size_bytes: int | None = field(default=None, compare=False)
    """Encoded size, when known (the writer knows it; a listing does not fetch it)."""

    @classmethod
    def from_url(cls, url: str) -> ShardRef:
        """Parse a shard URL; raises ``StreamConfigError`` when the name is not a shard name."""
        name = url.rstrip("/").rsplit("/", 1)[-1]
        match = _SHARD_RE.match(name)
        if match is None:
            raise StreamConfigError(f"{url!r} is not a Sluice shard name")
        return cls(
            name=name,
            url=url,
            commit_time_ns=int(match["ns"]),
            writer_id=match["writer"],
            num_groups=int(match["groups"]),
            num_rows=int(match["rows"]),
        )

    @property
    def tag(self) -> str:
        """The name's tag: ``shard_key_tag(key)`` for a keyed write, a sequence otherwise."""
        tag = tag_of(self.name)
        if tag is None:  # only from_url builds refs from listings, and it checks the name
            raise StreamConfigError(f"{self.name!r} is not a Sluice shard name")
        return tag

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for Prefect results and MLflow tags."""
        return dataclasses.asdict(self)
