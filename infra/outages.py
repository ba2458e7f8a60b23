"""Outages of the two services every role depends on: the object store and the tracking server.

A role talks to object storage (streams, checkpoints, status) and to MLflow (the
registry, metrics). Both client libraries retry a failed request with backoff on
their own (botocore's `standard` retry mode and s3fs for S3, urllib3 under MLflow's
client), so a blip of seconds is ridden out inside one call. When an endpoint stays
down longer than those retries, the call raises; this module says whether an
exception was such an outage (`outage_cause`), and probes an endpoint to tell when it
answers again (`probe_storage`, `probe_tracking`).

An outage is a connection that could not be made or that timed out, anywhere in the
exception's chain (a Sluice error wraps the library's). An answer, even an error
answer such as a missing object or a refused request, is not an outage: the service
is up and the problem is elsewhere.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")

EXIT_OUTAGE = 75
"""Exit code of a role process that stopped because a service stopped answering
(EX_TEMPFAIL: try again later). Its supervisor waits for the service, not a retry."""


@cache
def _outage_types() -> tuple[type[BaseException], ...]:
    """Connection and timeout errors of the libraries behind fsspec/s3fs and MLflow.

    Imported here, not at module level: a local-disk run never loads botocore.
    """
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from botocore import exceptions as botocore_errors

        types += [
            botocore_errors.EndpointConnectionError,
            botocore_errors.ConnectTimeoutError,
            botocore_errors.ReadTimeoutError,
            botocore_errors.ConnectionClosedError,
        ]
    except ImportError:
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError]
    except ImportError:
        pass
    try:
        import urllib3.exceptions as urllib3_errors

        types += [urllib3_errors.MaxRetryError, urllib3_errors.NewConnectionError]
        types += [urllib3_errors.ProtocolError, urllib3_errors.TimeoutError]
    except ImportError:
        pass
    try:
        import requests.exceptions as requests_errors

        types += [requests_errors.ConnectionError, requests_errors.Timeout]
    except ImportError:
        pass
    return tuple(types)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not e for e in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def outage_cause(exc: BaseException) -> BaseException | None:
    """The connection or timeout error behind `exc` (itself, or in its chain), if any.

    None means `exc` is not an outage: a bug, bad data, a refused request, a full disk.
    The deepest such error is returned, since it names what could not be reached.
    """
    found = [e for e in _chain(exc) if isinstance(e, _outage_types())]
    return found[-1] if found else None


def describe(exc: BaseException) -> str:
    """`Type: message` on one line, at most 300 characters."""
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def within(read: Callable[[], T], timeout_s: float) -> T | None:
    """`read()` if it returns within `timeout_s`, else None; what it raises is raised
    here. A hung endpoint can hold a request past any library timeout, so `read` runs
    in a daemon thread, left behind when it does not return: the caller's wait stays
    bounded and the process does not wait for it."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, read()))
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            box.append((False, err))

    thread = threading.Thread(target=run, name="sluice-within", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not box:
        return None
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _within(seconds: float, probe: Callable[[], None]) -> str | None:
    """Run `probe` for at most `seconds`: None when it returned, else what went wrong."""

    def answer() -> bool:
        probe()
        return True

    try:
        answered = within(answer, seconds)
    except Exception as exc:  # noqa: BLE001 - classified here
        cause = outage_cause(exc)
        return None if cause is None else describe(cause)
    return None if answered else f"no answer in {seconds:g} s"


def probe_storage(
    url: str, storage_options: Mapping[str, Any] | None = None, timeout_s: float = 10.0
) -> str | None:
    """None when the object store behind `url` answers, else why it does not.

    One small listing, one attempt: the probe asks whether the store answers now, so
    it leaves out the client's retries (which could outlast `timeout_s` against a
    store that is up but slow) and gives the request the whole `timeout_s`. An answer
    such as "no such key" counts as answering.
    """
    from sluice.infra.storage import open_filesystem

    options = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        once: dict[str, Any] = {"connect_timeout": timeout_s, "read_timeout": timeout_s}
        once["retries"] = {"max_attempts": 1}
        options["config_kwargs"] = {**options.get("config_kwargs", {}), **once}
        options["skip_instance_cache"] = True  # not the roles' cached client

    def probe() -> None:
        fs, path = open_filesystem(url, options)
        if hasattr(fs, "retries"):
            fs.retries = 1  # s3fs retries timeouts itself on top of botocore
        fs.invalidate_cache()
        fs.ls(path, detail=False)  # "no such key" is an answer too (see `_within`)

    return _within(timeout_s, probe)


def probe_tracking(tracking_uri: str, timeout_s: float = 10.0) -> str | None:
    """None when the MLflow tracking server answers, else why it does not.

    Only a server has an outage of its own; another backend (a sqlite file) answers.
    """
    if not tracking_uri.startswith(("http://", "https://")):
        return None

    def probe() -> None:
        try:
            with urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=timeout_s):
                pass
        except urllib.error.HTTPError:
            pass  # it answered

    return _within(timeout_s, probe)
