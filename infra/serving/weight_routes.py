"""SGLang's routes for weights sent by a trainer process, on Sluice's server.

- ``POST /init_weights_update_group``: join a process group as rank ``rank_offset``
  (this server has one rank: no tensor parallelism) with the trainer as rank 0, which
  hosts the rendezvous at ``master_address:master_port``. Gloo on a CPU server, NCCL on
  a GPU one; a CPU server asked for NCCL refuses in one line.
- ``POST /update_weights_from_distributed``: receive the tensors ``names``/``dtypes``/
  ``shapes`` list, broadcast by rank 0 one after another or, with ``load_format:
  "flattened_bucket"``, as one flat byte tensor. A trainer sends a version in several
  such calls (buckets).
- ``POST /update_weights_from_tensor``: ``serialized_named_tensors`` (one entry, base64,
  per tensor-parallel rank: one here) holds handles to tensors in the sender's memory,
  shared memory on a CPU and CUDA IPC on a GPU. **Accepted only from this host**: a
  handle names local memory, and reading one means unpickling, which only an allow-list
  of torch's tensor-rebuild functions may do here.
- ``POST /destroy_weights_update_group``.

Where Sluice departs from SGLang: SGLang copies each call's tensors into the served
model as they come, so a version sent in buckets is served half-new until the last one
(callers pause generation around it). Sluice's engine stages a version's tensors and
swaps them in atomically once every tensor of it has arrived
(``InferenceEngine.update_weights_from_tensors``), interruptibly, like a disk update.
A failed broadcast (a peer gone, the deadline passed) drops the group: the caller makes
a new one or loads from disk, and the served weights are untouched.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sluice.engines.inference.types import WeightLoadError
from sluice.engines.inference.weight_sync import (
    DEFAULT_GROUP_NAME,
    FLATTENED_BUCKET,
    SpecMismatch,
    TensorSpec,
    WeightGroup,
    WeightTransferError,
    check_alignment,
    deserialize_named_tensors,
    empty_bucket,
    unflatten,
)
from sluice.infra.serving import protocol
from sluice.infra.serving.limits import ServerLimits
from sluice.infra.serving.request_parsing import BadRequestError, json_body
from sluice.infra.serving.versions import UpdateLabel, VersionOrder, parse_label

if TYPE_CHECKING:
    from sluice.engines.inference.engine import InferenceEngine

log = logging.getLogger(__name__)
T = TypeVar("T")


def _answer(success: bool, message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message}, status_code=200 if success else status
    )


class _OneAtATime:
    """Work of one kind (forming a group, a collective), one call at a time, each in a
    daemon thread of its own off the default executor: however long it waits, the other
    routes' threads stay free, and a second call while one runs is refused at once
    instead of queueing behind it. A call still running at its deadline is abandoned
    (torch's store client can wait forever on a peer that accepts and never answers):
    the route answers, and the thread is left to end when it ends. At most
    ``MAX_ABANDONED`` such threads at a time; past that, calls are refused until one
    ends."""

    MAX_ABANDONED = 2

    def __init__(self, name: str) -> None:
        self._name = name
        self._busy = threading.Lock()
        self._abandoned: list[threading.Thread] = []

    @property
    def stuck(self) -> int:
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    async def run(self, work: Callable[[], T], deadline_s: float) -> T | None:
        """``work()``'s result; None when another call runs (or too many are stuck);
        TimeoutError past ``deadline_s``."""
        if self.stuck >= self.MAX_ABANDONED or not self._busy.acquire(blocking=False):
            return None
        future: Future[T] = Future()
        # The slot is freed once, by whichever comes first: the work ending, or the route
        # giving up on it (then the work, ending later, leaves the slot alone).
        ended = [False]
        handover = threading.Lock()

        def end() -> None:
            with handover:
                first, ended[0] = not ended[0], True
            if first:
                self._busy.release()

        def guarded() -> None:
            # The slot is freed before the outcome is handed over: the route answers only
            # after it, so the caller's next call never finds it still taken. The route
            # may have given up (the future is cancelled then): the outcome is dropped.
            try:
                result = work()
            except BaseException as exc:  # handed to the awaiting route
                end()
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(exc)
            else:
                end()
                with contextlib.suppress(InvalidStateError):
                    future.set_result(result)

        thread = threading.Thread(target=guarded, name=self._name, daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), deadline_s)
        except (TimeoutError, asyncio.CancelledError):  # past the deadline, or the caller left
            self._abandoned.append(thread)
            end()
            raise


def _object(body: Any, route: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """``body`` as a JSON object holding only SGLang's fields for ``route``."""
    if not isinstance(body, dict):
        raise BadRequestError(f"the {route} body must be a JSON object", contract=True)
    for key in body:
        if key not in fields:
            listed = ", ".join(f"`{k}`" for k in fields)
            raise BadRequestError(f"unknown field `{key}`, expected one of {listed}", contract=True)
    return body


def _typed(
    body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    if key not in body or body[key] is None:
        if default is ...:
            raise BadRequestError(f"{key} is required", contract=True)
        return default
    value = body[key]
    if isinstance(value, bool) and kind is int or not isinstance(value, kind):
        raise BadRequestError(f"{key} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _specs(body: dict[str, Any]) -> list[TensorSpec]:
    names, dtypes, shapes = (_typed(body, k, list) for k in ("names", "dtypes", "shapes"))
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise BadRequestError(
            f"names, dtypes and shapes must be non-empty and as long as each other, got "
            f"{len(names)}, {len(dtypes)} and {len(shapes)}"
        )
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise BadRequestError(f"tensor {name!r}: names and dtypes must be strings")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise BadRequestError(f"tensor {name}: shape must be a list of integers >= 0")
        specs.append(TensorSpec(name, dtype, tuple(shape)))
    try:
        for spec in specs:
            spec.nbytes  # noqa: B018  refuses an unknown dtype here, before any collective
    except WeightTransferError as exc:
        raise BadRequestError(str(exc)) from exc
    return specs


def _local_addresses() -> set[str]:
    addresses: set[str] = {"127.0.0.1", "::1", "localhost"}
    try:
        host = socket.gethostname()
        addresses.update(str(info[4][0]) for info in socket.getaddrinfo(host, None))
    except OSError:
        pass
    return addresses


def is_same_host(client_host: str | None) -> bool:
    """Whether a request came from this host (a loopback address or one of its own)."""
    if not client_host:
        return False
    try:
        if ipaddress.ip_address(client_host).is_loopback:
            return True
    except ValueError:
        pass
    return client_host in _local_addresses()


def add_weight_routes(
    app: FastAPI,
    engine: InferenceEngine,
    group_timeout_s: float,
    limits: ServerLimits | None = None,
    order: VersionOrder | None = None,
) -> None:
    """Serve SGLang's weight-sync routes; a group's collectives end within `group_timeout_s`.
    `limits` bounds who a group may be formed with; `order` is the (r, k) order every
    update must respect (``versions``)."""
    limits = limits or ServerLimits()
    order = order or VersionOrder()
    groups: dict[str, WeightGroup] = {}
    setup = _OneAtATime("weight-group-setup")
    # One collective at a time: a group's ranks must agree on order.
    collectives = _OneAtATime("weight-group-collective")

    def drop(name: str) -> None:
        group = groups.pop(name, None)
        if group is not None:
            group.close()

    @app.post(protocol.INIT_WEIGHTS_UPDATE_GROUP)
    async def init_weights_update_group(request: Request) -> JSONResponse:
        route = protocol.INIT_WEIGHTS_UPDATE_GROUP
        body = _object(
            await json_body(request, allow_empty=False), route, protocol.INIT_GROUP_FIELDS
        )
        address = _typed(body, "master_address", str)
        port = _typed(body, "master_port", int)
        rank_offset = _typed(body, "rank_offset", int)
        world_size = _typed(body, "world_size", int)
        name = _typed(body, "group_name", str, DEFAULT_GROUP_NAME)
        backend = _typed(body, "backend", str, "nccl")
        if not limits.master_address_allowed(address):
            # Never dialled: a group is formed with the run's sender only, so this route
            # cannot be used to probe other addresses.
            return _answer(
                False, f"master_address {address[:100]!r} is not the run's weight sender", 403
            )
        if not 1 <= port <= 65535:
            raise BadRequestError(f"master_port must be in [1, 65535], got {port}")
        if not 2 <= world_size <= limits.max_weight_world_size:
            raise BadRequestError(
                f"world_size must be in [2, {limits.max_weight_world_size}], got {world_size}"
            )
        if not 1 <= rank_offset < world_size:
            # Rank 0 hosts the rendezvous: the trainer's, never a server's.
            raise BadRequestError(f"rank_offset must be in [1, world_size), got {rank_offset}")
        if len(name) > 200:
            raise BadRequestError("group_name must be at most 200 characters")
        if backend not in ("nccl", "gloo"):
            return _answer(False, f"backend {backend[:20]!r} is not nccl or gloo")
        if backend == "nccl" and engine.device.type != "cuda":
            return _answer(
                False, f"backend 'nccl' needs a GPU; this server runs on {engine.device} (use gloo)"
            )
        if name in groups:
            return _answer(False, f"weight group {name!r} exists; destroy it first")

        def open_group() -> WeightGroup | WeightTransferError:
            try:
                return WeightGroup(
                    address, port, rank_offset, world_size, backend=backend, group_name=name,
                    timeout_s=group_timeout_s,
                ).connect()  # fmt: skip
            except WeightTransferError as exc:
                log.warning("weight group %r at %s:%d did not form: %s", name, address, port, exc)
                return exc

        try:
            group = await setup.run(open_group, 3 * group_timeout_s + 1.0)
        except TimeoutError:
            group = WeightTransferError("the rendezvous never answered")
        if group is None:
            return _answer(False, "another weight group is being formed; one at a time", 409)
        if isinstance(group, WeightTransferError):
            # Fixed text, from the request alone: what a peer at that address answered
            # is never echoed back (the route would read banners off any port).
            return _answer(
                False,
                f"Failed to initialize custom process group: weight group {name!r} did not "
                f"form at {address}:{port} (rank {rank_offset} of {world_size}, {backend}) "
                f"within {group_timeout_s:g} s",
            )
        groups[name] = group
        return _answer(True, "Succeeded to initialize custom process group.")

    @app.post(protocol.DESTROY_WEIGHTS_UPDATE_GROUP)
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        route = protocol.DESTROY_WEIGHTS_UPDATE_GROUP
        body = _object(
            await json_body(request, allow_empty=True), route, protocol.DESTROY_GROUP_FIELDS
        )
        name = _typed(body, "group_name", str, DEFAULT_GROUP_NAME)
        if name not in groups:
            return _answer(False, "The group to be destroyed does not exist.")
        await asyncio.to_thread(drop, name)
        return _answer(True, "Succeeded to destroy custom process group.")

    def common(body: dict[str, Any]) -> tuple[UpdateLabel, int, bool]:
        if body.get("selector", "all") not in ("target", "all"):
            raise BadRequestError("selector: Sluice's server has no draft model")
        for key in ("flush_cache", "abort_all_requests", "torch_empty_cache"):
            _typed(body, key, bool, False)
        label = parse_label(body.get("weight_version"), engine.weight_version)
        version = order.admit(label, engine.weight_version)
        return label, version, bool(body.get("abort_all_requests", False))

    def applied(report: Any, label: UpdateLabel, count: int) -> JSONResponse:
        if report is None:
            return _answer(True, f"Staged {count} tensors of weight version {label.step}.")
        order.served(label)
        return _answer(True, f"Succeeded to update model weights to version {label.step}.")

    async def apply(named: list[tuple[str, Any]], label: UpdateLabel, abort_all: bool,
                    source: str) -> Any:  # fmt: skip
        return await asyncio.to_thread(
            engine.update_weights_from_tensors, named, label.step,
            abort_all_requests=abort_all, source=source,
        )  # fmt: skip

    @app.post(protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED)
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        route = protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED
        body = _object(
            await json_body(request, allow_empty=False), route, protocol.DISTRIBUTED_FIELDS
        )
        specs = _specs(body)
        name = _typed(body, "group_name", str, DEFAULT_GROUP_NAME)
        load_format = body.get("load_format")
        if load_format not in (None, FLATTENED_BUCKET):
            raise BadRequestError(
                f"load_format={str(load_format)[:40]!r}: expected null or {FLATTENED_BUCKET!r}"
            )
        try:  # before any buffer or collective: a refused body leaves the group as it was
            if load_format == FLATTENED_BUCKET:
                check_alignment(specs)
            engine.check_tensor_specs(
                [(s.name, s.dtype, s.shape) for s in specs], sum(s.nbytes for s in specs)
            )
        except (WeightTransferError, SpecMismatch) as exc:
            raise BadRequestError(str(exc)) from exc
        label, _, abort_all = common(body)
        group = groups.get(name)
        if group is None:
            return _answer(
                False,
                f"weight group {name!r} does not exist; call {protocol.INIT_WEIGHTS_UPDATE_GROUP} first",
            )

        def receive() -> list[tuple[str, Any]] | WeightTransferError:
            try:
                if load_format == FLATTENED_BUCKET:
                    flat = empty_bucket(specs, engine.device)
                    group.broadcast(flat)
                    return unflatten(flat, specs)
                out = []
                for spec in specs:
                    tensor = empty_bucket([spec], engine.device)
                    group.broadcast(tensor)
                    out.extend(unflatten(tensor, [spec]))
                return out
            except WeightTransferError as exc:
                return exc

        try:
            named = await collectives.run(receive, len(specs) * group_timeout_s + 1.0)
        except TimeoutError:
            named = WeightTransferError(f"no broadcast within {group_timeout_s:g} s")
        if named is None:
            return _answer(False, "another collective is under way; one at a time", 409)
        if isinstance(named, WeightTransferError):
            await asyncio.to_thread(drop, name)  # its ranks no longer agree: make a new one
            return _answer(
                False, f"Failed to update parameter online: {named}; group {name!r} dropped"
            )
        try:
            report = await apply(named, label, abort_all, f"weight group {name!r}")
        except (WeightLoadError, ValueError) as exc:
            return _answer(False, str(exc))
        return applied(report, label, len(named))

    @app.post(protocol.UPDATE_WEIGHTS_FROM_TENSOR)
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        client = request.client.host if request.client is not None else None
        if not is_same_host(client):
            return JSONResponse(
                protocol.error_body(
                    f"{protocol.UPDATE_WEIGHTS_FROM_TENSOR} carries handles to memory on this "
                    f"host and is taken only from it, not from {client}",
                    403,
                ),
                status_code=403,
            )
        route = protocol.UPDATE_WEIGHTS_FROM_TENSOR
        body = _object(await json_body(request, allow_empty=False), route, protocol.TENSOR_FIELDS)
        serialized = _typed(body, "serialized_named_tensors", list)
        if len(serialized) != 1 or not isinstance(serialized[0], str):
            raise BadRequestError(
                "serialized_named_tensors must hold one base64 string (Sluice's server has one "
                f"tensor-parallel rank), got {len(serialized)} entries"
            )
        if body.get("load_format") is not None:
            raise BadRequestError(f"load_format={str(body['load_format'])[:40]!r}: expected null")
        label, _, abort_all = common(body)
        try:
            data = base64.b64decode(serialized[0], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadRequestError(f"serialized_named_tensors[0] is not base64: {exc}") from exc

        def read() -> list[tuple[str, Any]]:
            # Checked against the served model before a byte of the sender's is read;
            # what is read is this process's own copy (tensor_handles).
            return deserialize_named_tensors(data, engine.check_tensor_specs, device=engine.device)

        try:
            named = await asyncio.to_thread(read)
            report = await apply(named, label, abort_all, "shared memory")
        except (WeightTransferError, WeightLoadError, ValueError) as exc:
            return _answer(False, f"Failed to update weights from tensors: {exc}")
        return applied(report, label, len(named))

    app.state.weight_groups = groups
