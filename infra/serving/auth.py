"""The run's credential on the wire: bearer checks for servers, signatures for documents.

A run's control routes (the inference servers' and the trainer's weight sender's) move
or replace the policy, so every one of them asks for the run's token in SGLang's
``--api-key`` form, ``Authorization: Bearer <token>``: a real SGLang server started with
``--api-key`` and Sluice's own server are configured and called the same way. Only
``/health`` and ``/metrics`` stay open, and exactly those paths: SGLang exempts every
path that starts with ``/health``, ``/health_generate`` included, which generates;
here that route asks for the token too.

The token is compared in constant time (``hmac.compare_digest``), and a refusal is a
401 with one line that never echoes what was sent. The same token signs what the
rollout reads from storage or relays to a server (the sender's document, its handle
answers): HMAC-SHA256 over canonical JSON or over the bytes, so someone who can write
the bucket cannot point the rollout, and with it the token, at their own address.

Tokens arrive in a file (`read_token_file`), never on a command line (world-readable
in ``/proc/<pid>/cmdline``) or in the environment (readable by every process of the
same user in ``/proc/<pid>/environ``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from sluice.infra.secrets import private_partial

OPEN_PATHS = frozenset({"/health", "/metrics"})
"""The only routes answered without the token: liveness and Prometheus scrapes."""
SIGNATURE_KEY = "signature"
"""The key of a signed document that holds its signature (hex HMAC-SHA256)."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]


class CredentialError(RuntimeError):
    """The run's token is missing, unreadable or exposed; or a signature does not match."""


def bearer_headers(token: str | None) -> dict[str, str]:
    """The header a caller sends with every control request (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def authorized(presented: bytes | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries `token`, in constant time."""
    expected = f"Bearer {token}".encode()
    return hmac.compare_digest(presented or b"", expected)


class BearerAuth:
    """ASGI middleware: every HTTP route but `OPEN_PATHS` needs the run's bearer token.

    Pure ASGI rather than a FastAPI dependency, so a route added later is covered
    without anyone remembering to ask, and a refused body is never read."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        if not token:
            raise CredentialError("BearerAuth needs a non-empty token")
        self.app = app
        self._token = token

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = dict(scope.get("headers") or []).get(b"authorization")
        if authorized(presented, self._token):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        why = "no credential" if presented is None else "a wrong credential"
        body = json.dumps(
            {"error": f"401: {why}; send Authorization: Bearer <the run's token>"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def require_token(app: Any, token: str | None) -> None:
    """Install `BearerAuth` on a FastAPI/Starlette `app` (nothing without a token)."""
    if token:
        app.add_middleware(BearerAuth, token=token)


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in `path`, which must be a file no other user can read (mode 0600)."""
    where = Path(path)
    try:
        fd = os.open(where, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise CredentialError(
            f"cannot read the run's credential file {where}: {exc.strerror}"
        ) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CredentialError(f"the run's credential file {where} is not a regular file")
        if mode & 0o077:
            raise CredentialError(
                f"the run's credential file {where} has mode {stat.S_IMODE(mode):o}; "
                "it must be 0600 (readable by its owner only)"
            )
        token = os.read(fd, 4096).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if not token:
        raise CredentialError(f"the run's credential file {where} is empty")
    return token


def write_token_file(path: str | os.PathLike[str], token: str) -> Path:
    """Write `token` to `path` with mode 0600 from its first byte, replacing it whole."""
    where = Path(path)
    partial = private_partial(where, token.encode("ascii"))
    try:
        os.replace(partial, where)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return where


# ---------------------------------------------------------------- signatures


def canonical_json(document: dict[str, Any]) -> bytes:
    """The bytes a document's signature covers: sorted keys, no spaces, its signature out."""
    unsigned = {k: v for k, v in document.items() if k != SIGNATURE_KEY}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign_bytes(token: str, data: bytes) -> str:
    """Hex HMAC-SHA256 of `data` under the run's token."""
    return hmac.new(token.encode(), data, hashlib.sha256).hexdigest()


def verify_bytes(token: str, data: bytes, signature: Any) -> bool:
    """Whether `signature` is `data`'s under the token (constant time)."""
    if not isinstance(signature, str):
        return False
    return hmac.compare_digest(sign_bytes(token, data).encode(), signature.encode())


def sign_document(token: str, document: dict[str, Any]) -> dict[str, Any]:
    """`document` with its signature added."""
    return {**document, SIGNATURE_KEY: sign_bytes(token, canonical_json(document))}


def verify_document(token: str, document: Any, what: str) -> dict[str, Any]:
    """`document` when its signature is the run's; otherwise one line naming `what`."""
    if not isinstance(document, dict):
        raise CredentialError(f"{what} is not a JSON object")
    if not verify_bytes(token, canonical_json(document), document.get(SIGNATURE_KEY)):
        raise CredentialError(f"{what} is not signed with this run's credential: refused")
    return document
