"""Errors raised by trajectory streams; callers catch ``StreamError`` for all of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.infra.streams.names import ShardRef


class StreamError(Exception):
    """Base class of every error raised by Sluice streams."""


class StreamConfigError(StreamError, ValueError):
    """A stream URL, name or option that cannot work (unknown protocol, bad run name, ...)."""


class StreamStorageError(StreamError, OSError):
    """The storage behind a stream could not be reached or refused an operation."""


class SchemaError(StreamError, ValueError):
    """A table that does not satisfy the trajectory schema; nothing was written."""


class CorruptShardError(StreamError):
    """A committed shard that cannot be used; it has been moved out of the stream.

    The stream goes on: callers log it and continue with the next shard.
    """

    def __init__(self, ref: ShardRef, reason: str, quarantine_url: str | None) -> None:
        where = f"moved to {quarantine_url}" if quarantine_url else "could not be moved"
        super().__init__(f"corrupt shard {ref.url}: {reason} ({where})")
        self.ref = ref
        """The shard that was quarantined."""
        self.reason = reason
        """Why it could not be used."""
        self.quarantine_url = quarantine_url
        """Where it now lives, or None when the move itself failed."""
