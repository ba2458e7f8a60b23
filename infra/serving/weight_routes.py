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
import ipaddress
import socket
import threading
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sluice.engines.inference.types import WeightLoadError
from sluice.engines.inference.weight_sync import (
    DEFAULT_GROUP_NAME,
    FLATTENED_BUCKET,
    TensorSpec,
    WeightGroup,
    WeightTransferError,
    check_alignment,
    deserialize_named_tensors,
    empty_bucket,
    unflatten,
)
from sluice.infra.serving import protocol
from sluice.infra.serving.request_parsing import BadRequestError, json_body, parse_update_version

if TYPE_CHECKING:
    from sluice.engines.inference.engine import InferenceEngine


def _answer(success: bool, message: str) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message}, status_code=200 if success else 400
    )


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


def add_weight_routes(app: FastAPI, engine: InferenceEngine, group_timeout_s: float) -> None:
    """Serve SGLang's weight-sync routes; a group's collectives end within `group_timeout_s`."""
    groups: dict[str, WeightGroup] = {}
    lock = threading.Lock()  # one collective at a time: a group's ranks must agree on order

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
        if backend not in ("nccl", "gloo"):
            return _answer(False, f"backend {backend!r} is not nccl or gloo")
        if backend == "nccl" and engine.device.type != "cuda":
            return _answer(
                False, f"backend 'nccl' needs a GPU; this server runs on {engine.device} (use gloo)"
            )
        if name in groups:
            return _answer(False, f"weight group {name!r} exists; destroy it first")

        def open_group() -> WeightGroup:
            return WeightGroup(
                address, port, rank_offset, world_size, backend=backend, group_name=name,
                timeout_s=group_timeout_s,
            ).connect()  # fmt: skip

        try:
            group = await asyncio.to_thread(open_group)
        except WeightTransferError as exc:
            return _answer(False, f"Failed to initialize custom process group: {exc}")
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

    def common(body: dict[str, Any]) -> tuple[int, bool]:
        if body.get("selector", "all") not in ("target", "all"):
            raise BadRequestError("selector: Sluice's server has no draft model")
        for key in ("flush_cache", "abort_all_requests", "torch_empty_cache"):
            _typed(body, key, bool, False)
        version = parse_update_version(body.get("weight_version"), engine.weight_version)
        return version, bool(body.get("abort_all_requests", False))

    def applied(report: Any, version: int, count: int) -> JSONResponse:
        if report is None:
            return _answer(True, f"Staged {count} tensors of weight version {version}.")
        return _answer(True, f"Succeeded to update model weights to version {version}.")

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
                f"load_format={load_format!r}: expected null or {FLATTENED_BUCKET!r}"
            )
        if load_format == FLATTENED_BUCKET:
            try:  # before any collective: a refused body leaves the group as it was
                check_alignment(specs)
            except WeightTransferError as exc:
                raise BadRequestError(str(exc)) from exc
        version, abort_all = common(body)
        group = groups.get(name)
        if group is None:
            return _answer(
                False,
                f"weight group {name!r} does not exist; call {protocol.INIT_WEIGHTS_UPDATE_GROUP} first",
            )

        def receive() -> list[tuple[str, Any]]:
            with lock:
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

        try:
            named = await asyncio.to_thread(receive)
        except WeightTransferError as exc:
            await asyncio.to_thread(drop, name)  # its ranks no longer agree: make a new one
            return _answer(
                False, f"Failed to update parameter online: {exc}; group {name!r} dropped"
            )
        try:
            report = await asyncio.to_thread(
                engine.update_weights_from_tensors, named, version,
                abort_all_requests=abort_all, source=f"weight group {name!r}",
            )  # fmt: skip
        except (WeightLoadError, ValueError) as exc:
            return _answer(False, str(exc))
        return applied(report, version, len(named))

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
            raise BadRequestError(f"load_format={body['load_format']!r}: expected null")
        version, abort_all = common(body)
        try:
            data = base64.b64decode(serialized[0], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadRequestError(f"serialized_named_tensors[0] is not base64: {exc}") from exc

        def load() -> tuple[Any, int]:
            named = deserialize_named_tensors(data)
            report = engine.update_weights_from_tensors(
                named, version, abort_all_requests=abort_all, source="shared memory"
            )
            return report, len(named)

        try:
            report, count = await asyncio.to_thread(load)
        except (WeightTransferError, WeightLoadError, ValueError) as exc:
            return _answer(False, f"Failed to update weights from tensors: {exc}")
        return applied(report, version, count)

    app.state.weight_groups = groups
