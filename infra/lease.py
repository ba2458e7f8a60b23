"""A time-limited claim on one object in storage: one trainer per run.

The lease is a small JSON document (``owner``, ``host``, ``pid``, ``expires_at``) put
atomically through ``sluice.infra.storage``. Whoever holds it renews it from a background
thread every ``ttl_s / 3``; a holder that dies stops renewing, and its lease expires.

Acquiring, a claimant takes the lease when there is none, when it has expired, or when
its holder is a process on this host that no longer exists (a trainer killed and
restarted on the same machine does not wait out the expiry). Otherwise it watches:
if the holder renews while it waits, the holder is alive and the claim is refused at
once (``LeaseHeld``, one line naming the holder); if the lease expires, it is taken.
After writing, the claimant reads the document back a moment later: of two claimants
that wrote at the same time, the one whose write landed last holds it and the other
is refused. Object stores with read-after-write consistency (S3, local disks) make
that read-back decisive.

A holder that finds another owner in the document while renewing (it stalled past the
expiry and someone took over) has lost the lease: ``check()`` raises ``LeaseLost`` so
the trainer stops before it publishes anything.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec

from sluice.infra.storage import exists, put_atomic

log = logging.getLogger(__name__)

SETTLE_S = 0.5
"""How long a claimant waits before reading its write back."""


class LeaseHeld(RuntimeError):
    """Another live process holds the lease."""


class LeaseLost(RuntimeError):
    """The lease passed to another owner while this one held it."""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a zombie, killed but not yet
    reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust the signal
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


class StorageLease:
    """One holder at a time for ``path`` on ``fs``; see the module docstring."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        path: str,
        *,
        what: str,
        ttl_s: float = 60.0,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.fs = fs
        self.path = path
        self.what = what
        self.ttl_s = ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None

    # ------------------------------------------------------------ document

    def _read(self) -> dict[str, Any] | None:
        try:
            if not exists(self.fs, self.path):
                return None
            document = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            log.warning("%s at %s is not a lease document; replacing it", self.what, self.path)
            return None
        return document if isinstance(document, dict) else None

    def _write(self) -> None:
        document = {
            "owner": self.owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "expires_at": time.time() + self.ttl_s,
            "ttl_s": self.ttl_s,
        }
        put_atomic(self.fs, self.path, json.dumps(document).encode())

    def _free(self, document: dict[str, Any] | None) -> bool:
        """Whether the lease in `document` can be taken now."""
        if document is None or document.get("owner") == self.owner:
            return True
        if float(document.get("expires_at", 0)) <= time.time():
            return True
        same_host = document.get("host") == socket.gethostname()
        return same_host and not pid_alive(int(document.get("pid", -1)))

    def _refusal(self, document: dict[str, Any]) -> LeaseHeld:
        left = float(document.get("expires_at", 0)) - time.time()
        return LeaseHeld(
            f"{self.what} is held by process {document.get('pid')} on "
            f"{document.get('host')} ({self.path}), which renewed it {left:.0f} s before "
            "it would expire; stop that process first (a dead holder's lease expires "
            f"after {self.ttl_s:g} s)"
        )

    # ------------------------------------------------------------ lifecycle

    def acquire(self) -> None:
        """Take the lease or raise ``LeaseHeld``; waits at most one ``ttl_s`` for a
        holder that may be dead, and starts renewing once held."""
        deadline = time.monotonic() + self.ttl_s + SETTLE_S
        seen: dict[str, Any] | None = None
        while True:
            document = self._read()
            if self._free(document):
                self._write()
                time.sleep(SETTLE_S)
                document = self._read()
                if document is not None and document.get("owner") == self.owner:
                    break
            if document is None:
                continue
            if seen is not None and (
                document.get("owner") != seen.get("owner")
                or document.get("expires_at") != seen.get("expires_at")
            ):
                raise self._refusal(document)  # renewed (or taken) while we watched: alive
            if time.monotonic() > deadline:
                raise self._refusal(document)
            seen = document
            log.info(
                "%s is held by %s until %.0f s from now; waiting to see whether it renews",
                self.what, document.get("owner"), float(document.get("expires_at", 0)) - time.time(),
            )  # fmt: skip
            time.sleep(min(2.0, self.ttl_s / 6))
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                document = self._read()
                if document is not None and document.get("owner") != self.owner:
                    self._lost = str(document.get("owner"))
                    log.error("%s was taken over by %s", self.what, self._lost)
                    return
                self._write()
            except Exception as exc:  # storage trouble: the next renewal tries again
                log.warning("renewing %s failed (%s); retrying", self.what, exc)

    def check(self) -> None:
        """Raise ``LeaseLost`` if another owner took the lease."""
        if self._lost is not None:
            raise LeaseLost(f"{self.what} was taken over by {self._lost}; stopping")

    def release(self) -> None:
        """Stop renewing and remove the document if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        try:
            document = self._read()
            if document is not None and document.get("owner") == self.owner:
                self.fs.rm(self.path)
        except Exception as exc:  # it expires on its own
            log.warning("releasing %s failed: %s", self.what, exc)

    def __enter__(self) -> StorageLease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
