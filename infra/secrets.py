"""Secrets in a run config, and the one redaction everything that leaves the process uses.

A config may carry credentials in two places: fsspec ``storage.options`` (``key``,
``secret``, ``token``, ``client_kwargs: {aws_secret_access_key: ...}``, ...) and the
password of any URI's userinfo (``tracking.uri = http://user:pass@host:5000``). The run
needs them, but MLflow params and artifacts, Prefect flow-run and deployment parameters,
``--dry-run`` output, logs and error messages are read by people and services that must
not. So whatever leaves the process goes through `redact_config` (a config dict) or
`redact_text` (a message); the real values reach the roles only through files written
0600 (`write_private_json`): the resolved ``config.json`` each role reads, and the
``secrets.json`` the CLI leaves beside it for the flow (`restore_secrets`).

Redaction keeps the shape: a redacted value is the string ``REDACTED`` where a secret
was, so a redacted config still validates and shows which keys were set.
"""

from __future__ import annotations

import copy
import json
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REDACTED = "<redacted>"
"""What a secret value becomes wherever config leaves the process."""
SECRETS_FILE = "secrets.json"
"""The 0600 file beside a run's ``config.json`` holding the values its flow parameters
left out (written by the CLI, read by the flow)."""

_SECRET_KEYS = frozenset(
    {"key", "secret", "token", "password", "passwd", "session_token", "credentials"}
)
# Substrings that make any option name a secret (aws_secret_access_key, sas_token,
# account_key, client_secret, api_key, access_key_id, ...).
_SECRET_PARTS = ("secret", "password", "passwd", "token", "credential", "_key", "key_id")
_URI_WITH_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/@'\"]*:[^\s/@'\"]*@")


def is_secret_key(name: str) -> bool:
    """Whether an fsspec option called `name` holds a credential."""
    lowered = str(name).lower()
    return lowered in _SECRET_KEYS or any(part in lowered for part in _SECRET_PARTS)


def _password(uri: str) -> str | None:
    try:
        return urlsplit(uri).password
    except ValueError:
        return None


def redact_uri(uri: str) -> str:
    """`uri` with the password of its userinfo replaced (``http://u:***@h`` keeps ``u``)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    if parts.password is None:
        return uri
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{host}"))


def without_userinfo(uri: str) -> str:
    """`uri` with no ``user:password@`` at all (for a request that must not carry it)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _redact_options(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if is_secret_key(k) and v not in (None, "") else _redact_options(v))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_redact_options(v) for v in value]
    if isinstance(value, str):
        return redact_uri(value)
    return value


def _redact_uris(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _redact_uris(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_uris(v) for v in value]
    if isinstance(value, str):
        return redact_uri(value)
    return value


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a config dict (``RunConfig.model_dump(mode="json")``) safe to show:
    secret ``storage.options`` and every URI's password replaced by `REDACTED`."""
    out = _redact_uris(config)
    storage = out.get("storage")
    if isinstance(storage, dict) and "options" in storage:
        storage["options"] = _redact_options(storage["options"])
    return out


def secret_values(config: Mapping[str, Any]) -> list[str]:
    """Every secret string of a config dict (what `redact_text` hides), longest first."""
    found: set[str] = set()

    def walk(real: Any, shown: Any) -> None:
        if isinstance(real, Mapping) and isinstance(shown, Mapping):
            for key, value in real.items():
                walk(value, shown.get(key))
        elif isinstance(real, list | tuple) and isinstance(shown, list):
            for value, masked in zip(real, shown, strict=False):
                walk(value, masked)
        elif real != shown and real not in (None, ""):
            # A URI's password alone, so an error line still names the host.
            password = _password(real) if isinstance(real, str) else None
            found.add(password or str(real))

    walk(config, redact_config(config))
    return sorted((s for s in found if len(s) >= 4), key=len, reverse=True)


_remembered: set[str] = set()


def remember_secrets(config: Mapping[str, Any]) -> None:
    """Make `redact_text` in this process hide the secrets of `config` (a config dict,
    validated or not): the CLI calls it as it loads a config, so any later error line
    is cleaned whatever raised it."""
    _remembered.update(secret_values(config))


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` (an error message, a log line) with every URI password, each of `secrets`
    (`secret_values`) and each secret this process remembers replaced by `REDACTED`."""
    for secret in sorted({*secrets, *_remembered}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return _URI_WITH_USERINFO.sub(lambda m: redact_uri(m.group(0) + "h").removesuffix("h"), text)


def has_redactions(config: Any) -> bool:
    """Whether a config dict holds `REDACTED` anywhere (its secrets were left out)."""
    return REDACTED in json.dumps(config, default=str)


def restore_secrets(shown: Mapping[str, Any], real: Mapping[str, Any]) -> dict[str, Any]:
    """`shown` (a redacted config dict) with every redacted value taken from `real`;
    a value given in `shown` itself wins. `real` holds the secret-bearing sections."""

    def merge(masked: Any, value: Any) -> Any:
        if isinstance(masked, Mapping) and isinstance(value, Mapping):
            return {k: merge(v, value.get(k)) for k, v in masked.items()}
        if isinstance(masked, list) and isinstance(value, list | tuple):
            return [merge(m, v) for m, v in zip(masked, value, strict=False)]
        if isinstance(masked, str) and REDACTED in masked and value is not None:
            return value
        return masked

    return merge(copy.deepcopy(dict(shown)), real)


def private_partial(path: Path, data: bytes) -> Path:
    """A new sibling of `path` holding `data`, readable by this user only (0600 from its
    first byte, never opened through a link) and synced: the caller renames or links it
    into place, and removes it if that fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, 0o600)  # whatever the umask
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


def write_private_json(path: Path, payload: Any) -> Path:
    """Write `payload` as JSON to `path`, readable by this user only (0600), whole or
    not at all (`private_partial`, then renamed)."""
    temp = private_partial(path, json.dumps(payload, indent=2).encode())
    try:
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return path
