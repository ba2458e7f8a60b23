"""The run's one credential: minted by the flow at start, kept in a 0600 file on each
node's local disk, read by the roles and servers of the run on that node.

Every control route of the run (the inference servers', the trainer's weight sender's)
asks for it (infra/serving/auth.py). It lives in the local run directory
(``{workdir}/runs/{run}/run.token``) and nowhere else: not in the environment (every
process of the same user reads ``/proc/<pid>/environ``), not on storage (the bucket may
be S3, shared with whoever can list it), never in a log line, an MLflow param or a
Prefect parameter. A node the flow does not run on gets it as a Ray call argument and
writes its own file (`write_run_token`); a server container reads the same file through
the read-only mount of the workdir.

A resumed run gets a new token: its servers and sender are started afresh anyway. The
documents on storage that tell the rollout where to send it (the launched servers', the
weight sender's) carry an HMAC under it, checked before a URL is trusted with it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Any

from sluice.infra.config.run import RunConfig
from sluice.infra.secrets import private_partial
from sluice.infra.serving.auth import (
    CredentialError,
    read_token_file,
    sign_document,
    verify_document,
    write_token_file,
)
from sluice.tasks.run.control import SERVERS_FILE, launched_server_urls, write_launched_servers
from sluice.tasks.run.paths import read_json, run_paths

TOKEN_FILE = "run.token"
"""The credential's file name in the local run directory."""


def token_path(config: RunConfig, run_id: str) -> Path:
    """Where this node keeps `run_id`'s token (absolute: a container mounts it there)."""
    return (Path(config.workdir) / "runs" / run_id / TOKEN_FILE).resolve()


def mint_run_token(config: RunConfig, run_id: str) -> Path:
    """A fresh random token for the run, written 0600; its path (never the token itself,
    which a caller could otherwise log)."""
    return write_token_file(token_path(config, run_id), secrets.token_urlsafe(32))


def write_run_token(config: RunConfig, run_id: str, token: str) -> Path:
    """The flow's token, written on this node (a Ray node the flow does not run on)."""
    return write_token_file(token_path(config, run_id), token)


def run_token(config: RunConfig, run_id: str) -> str:
    """The run's token on this node.

    A role started without a flow (a test, a hand-started role) finds no file: it mints
    one then, created exclusively, so every role on the node agrees on the first one
    written. Roles on several nodes need the flow's, or each would hold its own.
    """
    path = token_path(config, run_id)
    if not path.exists():
        _create_if_absent(path, secrets.token_urlsafe(32))
    return read_token_file(path)


def write_signed_servers(config: RunConfig, run_id: str, urls: list[str], **more: Any) -> None:
    """The launched servers' document (`write_launched_servers`), signed with the token."""
    document = sign_document(run_token(config, run_id), {"urls": urls, **more})
    write_launched_servers(config, run_id, **document)


def verified_servers(config: RunConfig, run_id: str, document: Any) -> dict[str, Any]:
    """The launched servers' document once its signature is the run's (one line if not):
    a URL written there by anyone else would be sent the token with every request."""
    return verify_document(run_token(config, run_id), document, f"the run's {SERVERS_FILE}")


def verified_server_urls(config: RunConfig, run_id: str) -> list[str]:
    """`launched_server_urls`, once `verified_servers` vouches for the document."""
    urls = launched_server_urls(config, run_id)  # names a missing document in one line
    document = read_json(config, f"{run_paths(config, run_id).control}/{SERVERS_FILE}")
    verified = verified_servers(config, run_id, document)
    if verified.get("urls") != urls:  # replaced between the two reads: take neither
        raise CredentialError(f"the run's {SERVERS_FILE} changed while it was read")
    return urls


def handle_message(version: int, data: bytes) -> bytes:
    """What the signature of a weight sender's handle covers: its bytes and the version
    they hold, so an old version's signed handles cannot be passed off as a newer one's.
    The train role's sender signs it and the rollout role checks it, so it is named here,
    in neither room."""
    return f"policy-version:{int(version)}:".encode() + data


def _create_if_absent(path: Path, token: str) -> None:
    partial = private_partial(path, token.encode("ascii"))
    try:
        os.link(partial, path)  # fails if another process was first: theirs stands
    except FileExistsError:
        pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()


__all__ = [
    "TOKEN_FILE",
    "CredentialError",
    "handle_message",
    "mint_run_token",
    "run_token",
    "token_path",
    "verified_server_urls",
    "verified_servers",
    "write_run_token",
    "write_signed_servers",
]
