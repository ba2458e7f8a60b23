"""How much one caller may ask of an inference server, and the checks that hold it there.

A server is reached by the rollout, and by whatever else reaches its port: nothing a
peer sends may make it allocate, queue or wait without bound. ``ServerLimits`` holds
the bounds (server options, whose defaults sit far above what any shipped config
asks); ``BodyLimit`` refuses an oversized body from its ``Content-Length`` and, when
the header is absent or lies, while reading it, before any byte is parsed.

Departure from SGLang: SGLang bounds its queue (``--max-queued-requests``, 503 past it)
but neither ``n`` nor prompts per call nor body size; here each is a 400 or 413 that
names the bound.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_ADDRESSES = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may ask (see the module notes)."""

    max_n: int = 1024
    """Samples per prompt (``sampling_params.n``); a GRPO group is 8 to 64."""
    max_prompts_per_call: int = 4096
    """Prompts in one batched ``/generate``."""
    max_request_bytes: int = 64 << 20
    """Bytes of any request body (a 4096-prompt batch of 2048 tokens is ~50 MB)."""
    max_queued_requests: int = 16384
    """Samples waiting for a slot, this call's included; past it a call gets 503 and
    queues nothing (SGLang's ``--max-queued-requests``)."""
    max_weight_world_size: int = 1024
    """``world_size`` of a weight group: the trainer and every server it feeds."""
    weight_master_addresses: frozenset[str] = field(
        default_factory=lambda: frozenset(LOOPBACK_ADDRESSES)
    )
    """The rendezvous addresses a weight group may be formed at: the run's sender's
    (the launcher adds it); anything else is refused before a connection is tried."""

    def __post_init__(self) -> None:
        for name in ("max_n", "max_prompts_per_call", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests < 1 or self.max_weight_world_size < 2:
            raise ValueError("max_queued_requests must be >= 1 and max_weight_world_size >= 2")

    def master_address_allowed(self, address: str) -> bool:
        """Whether a weight group may be formed at ``address`` (compared as an IP address
        where it is one, so ``::1`` and ``0:0::1`` are the same)."""
        return _canonical(address) in {_canonical(a) for a in self.weight_master_addresses}


def _canonical(address: str) -> str:
    try:
        return str(ipaddress.ip_address(address.strip("[]")))
    except ValueError:
        return address.strip().lower()


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` is answered 413 in one line, from its
    ``Content-Length`` before reading, or as soon as the bytes read pass the bound."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._refuse(send, "the Content-Length header is not a number", 400)
                    return
                if declared > self.max_bytes:
                    await self._refuse(send, self._over(declared), 413)
                    return
        seen = 0
        started = False

        async def bounded_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(seen)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except _TooLarge as exc:
            if not started:
                await self._refuse(send, self._over(exc.seen, read=True), 413)

    def _over(self, size: int, *, read: bool = False) -> str:
        what = "read so far" if read else "declared"
        return f"the request body is over {self.max_bytes} bytes ({size} {what})"

    @staticmethod
    async def _refuse(send: Send, message: str, status: int) -> None:
        body = json.dumps({"object": "error", "message": message, "type": "BadRequest",
                           "param": None, "code": status}).encode()  # fmt: skip
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    def __init__(self, seen: int) -> None:
        super().__init__(seen)
        self.seen = seen


def add_limit_arguments(parser: Any) -> None:
    """The server's command-line options for ``ServerLimits`` (an argparse parser)."""
    defaults = ServerLimits()
    for name, help_text in (
        ("max_n", "samples per prompt (sampling_params.n)"),
        ("max_prompts_per_call", "prompts in one /generate call"),
        ("max_request_bytes", "bytes of a request body (413 past it)"),
        ("max_queued_requests", "samples waiting for a slot (503 past it)"),
        ("max_weight_world_size", "world_size of a weight group"),
    ):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(defaults, name), help=help_text)
    parser.add_argument(
        "--weight-master-address",
        action="append",
        default=None,
        help="an address a weight group may be formed at (the run's sender); repeat for "
        f"more; default {', '.join(LOOPBACK_ADDRESSES)}",
    )


def limits_of(args: Any) -> ServerLimits:
    """The ``ServerLimits`` parsed command-line options name."""
    return ServerLimits(
        max_n=args.max_n,
        max_prompts_per_call=args.max_prompts_per_call,
        max_request_bytes=args.max_request_bytes,
        max_queued_requests=args.max_queued_requests,
        max_weight_world_size=args.max_weight_world_size,
        weight_master_addresses=frozenset(args.weight_master_address or LOOPBACK_ADDRESSES),
    )
