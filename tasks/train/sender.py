"""The trainer's side of the fast weight paths: each published version's weights, held in
memory in the dtype the servers run, offered over a small HTTP API in the train role's
process.

The train role calls `offer` right after a step it publishes: one copy of the weights
(float32 → the serving dtype) into flat buckets, in shared memory on a CPU. That copy is
all the trainer pays on its critical path; the durable checkpoint and the registry
commit go on in the background as before (tasks/train/role.py). The rollout role reads this
API only for a version the registry has committed (it gates; this process never pushes),
and moves the bytes one of two ways:

- ``GET /versions/{v}``: the tensor list and its buckets (404: not held here any more,
  load from disk);
- ``GET /versions/{v}/handles``: shared-memory (CPU) or CUDA IPC (GPU) handles to the
  buckets, the body of a server's ``/update_weights_from_tensor``; same host only, and
  one request per receiving process (a handle is mapped once);
- ``POST /groups``: open a weight group as its rank 0 (``{master_address,
  master_port}``, the body of each server's ``/init_weights_update_group``), formed in
  the background (``GET /groups/{name}``); ``POST /groups/{name}/broadcast`` sends one
  bucket of a version while the servers receive it (``/update_weights_from_distributed``);
  ``DELETE /groups/{name}``.

Every route but ``/health`` asks for the run's token (infra/serving/auth.py), and the
handles are signed with it: the rollout relays them to servers only once the signature
says they came from this process. The API binds the node's private address (loopback on
one node), never every interface.

Only the newest `keep` versions are held; a broadcast fails (and drops the group) when a
server is gone or the group's deadline passes, never hangs.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sluice.engines.inference.weight_sync import (
    DEFAULT_GROUP_NAME,
    TensorSpec,
    WeightGroup,
    WeightTransferError,
    dtype_name,
    empty_bucket,
    plan_buckets,
    serialize_named_tensors,
    unflatten,
    unique_named_tensors,
)
from sluice.infra.serving.auth import require_token, sign_bytes
from sluice.infra.serving.weight_routes import is_same_host
from sluice.tasks.run.credential import handle_message

log = logging.getLogger("sluice.train")


@dataclass
class HeldVersion:
    """One version's weights as flat byte buckets, and the tensors as views of them."""

    version: int
    specs: list[TensorSpec]
    buckets: list[list[int]]
    flat: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel()) for t in self.flat)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for flat, indices in zip(self.flat, self.buckets, strict=True):
            out.extend(unflatten(flat, [self.specs[i] for i in indices]))
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "names": [s.name for s in self.specs],
            "dtypes": [s.dtype for s in self.specs],
            "shapes": [list(s.shape) for s in self.specs],
            "buckets": self.buckets,
            "bytes": self.nbytes,
        }


def snapshot(
    state: dict[str, torch.Tensor], dtype: torch.dtype, bucket_bytes: int, version: int
) -> HeldVersion:
    """``state`` copied once into flat buckets of ``dtype`` (shared memory on a CPU)."""
    with torch.no_grad():
        named = unique_named_tensors(state)
        specs = [  # floating tensors travel in the servers' dtype
            TensorSpec(
                name, dtype_name(dtype if t.is_floating_point() else t.dtype), tuple(t.shape)
            )
            for name, t in named
        ]
        buckets = plan_buckets(specs, bucket_bytes)
        device = next(iter(state.values())).device
        flat = []
        for indices in buckets:
            # Allocated where another process can map it, then filled: one copy (and
            # the dtype conversion) per tensor; the next step cannot change it.
            bucket = empty_bucket([specs[i] for i in indices], device, shared_memory=True)
            views = unflatten(bucket, [specs[i] for i in indices])
            for (_, view), i in zip(views, indices, strict=True):
                view.copy_(named[i][1])
            flat.append(bucket)
    return HeldVersion(version, specs, buckets, flat)


class WeightSender:
    """Holds the newest `keep` published versions and serves them (see the module doc)."""

    def __init__(
        self,
        *,
        dtype: torch.dtype,
        bucket_bytes: int,
        group_timeout_s: float,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        keep: int = 2,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the run's token, asked of every caller and signing the handles
        (None: an open sender, for tests of the transfer alone)."""
        self.dtype, self.bucket_bytes, self.keep = dtype, bucket_bytes, keep
        self._api_key = api_key
        self.group_timeout_s = group_timeout_s
        self.bind_host = bind_host
        self.advertise_host = advertise_host or (
            bind_host
            if bind_host not in ("0.0.0.0", "::")
            else socket.gethostbyname(socket.gethostname())
        )
        self.held: dict[int, HeldVersion] = {}
        self.groups: dict[str, WeightGroup] = {}
        self.forming: dict[str, str] = {}
        """Group name -> "forming", "ready" or the error that ended it."""
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one broadcast at a time: the ranks agree on order
        self._server: Any = None
        self.url = ""

    # ------------------------------------------------------------ trainer side

    def offer(self, version: int, state: dict[str, torch.Tensor]) -> float:
        """Hold `version`'s weights (`state`, the trainer's) for the rollout; returns the
        bytes held. Older versions beyond `keep` are let go."""
        held = snapshot(state, self.dtype, self.bucket_bytes, version)
        with self._lock:
            self.held[version] = held
            for old in sorted(self.held)[: -self.keep]:
                del self.held[old]
        return float(held.nbytes)

    def get(self, version: int) -> HeldVersion | None:
        with self._lock:
            return self.held.get(version)

    # ------------------------------------------------------------ groups

    def open_group(self, name: str, world_size: int, backend: str) -> dict[str, Any]:
        """Start group `name` as rank 0; it forms in the background once the servers join."""
        self.close_group(name)
        group = WeightGroup(
            self.bind_host if self.bind_host not in ("0.0.0.0", "::") else self.advertise_host,
            0, 0, world_size, backend=backend, group_name=name, timeout_s=self.group_timeout_s,
        )  # fmt: skip
        with self._lock:
            self.groups[name] = group
            self.forming[name] = "forming"

        def form() -> None:
            try:
                group.connect()
                state = "ready"
            except WeightTransferError as exc:
                state = str(exc)
            with self._lock:
                if self.groups.get(name) is group:
                    self.forming[name] = state
                    if state != "ready":
                        self.groups.pop(name, None)
                        group.close()

        threading.Thread(target=form, name=f"weight-group-{name}", daemon=True).start()
        return {"master_address": self.advertise_host, "master_port": group.port}

    def group_state(self, name: str) -> str:
        with self._lock:
            return self.forming.get(name, "absent")

    def close_group(self, name: str) -> None:
        with self._lock:
            group = self.groups.pop(name, None)
            self.forming.pop(name, None)
        if group is not None:
            group.close()

    def broadcast(self, name: str, version: int, bucket: int) -> None:
        """Send bucket `bucket` of `version` to group `name` (the servers are receiving).
        WeightTransferError (the group dropped) when that fails."""
        held = self.get(version)
        if held is None:
            raise WeightTransferError(f"policy version {version} is not held by the trainer")
        if not 0 <= bucket < len(held.flat):
            raise WeightTransferError(
                f"version {version} has {len(held.flat)} buckets, not {bucket + 1}"
            )
        with self._lock:
            group = self.groups.get(name) if self.forming.get(name) == "ready" else None
        if group is None:
            raise WeightTransferError(
                f"weight group {name!r} is not formed ({self.group_state(name)})"
            )
        try:
            with self._send_lock:
                group.broadcast(held.flat[bucket])
        except WeightTransferError:
            self.close_group(name)
            raise

    # ------------------------------------------------------------ HTTP

    def start(self) -> str:
        """Serve the API on a free port; returns its URL."""
        from sluice.infra.serving.server import ServerThread

        self._server = ServerThread(self.app(), host=self.bind_host, port=0)
        self._server.start()
        self.url = f"http://{self.advertise_host}:{self._server.port}"
        return self.url

    def stop(self) -> None:
        for name in list(self.groups):
            self.close_group(name)
        with self._lock:
            self.held = {}
        if self._server is not None:
            self._server.stop(timeout_s=5.0)
            self._server = None

    def app(self) -> FastAPI:
        app = FastAPI(title="Sluice trainer weight sender")
        require_token(app, self._api_key)

        def missing(version: int) -> JSONResponse:
            return JSONResponse({"error": f"policy version {version} is not held"}, status_code=404)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            with self._lock:
                return {"versions": sorted(self.held)}

        @app.get("/versions/{version}")
        async def describe(version: int) -> JSONResponse:
            held = self.get(version)
            return missing(version) if held is None else JSONResponse(held.describe())

        @app.get("/versions/{version}/handles")
        async def handles(version: int, request: Request) -> JSONResponse:
            client = request.client.host if request.client is not None else None
            if not is_same_host(client):
                return JSONResponse({"error": "handles name memory on this host"}, status_code=403)
            held = self.get(version)
            if held is None:
                return missing(version)
            # Made afresh for each request. A server copies the segments' bytes into its
            # own memory as they arrive and keeps no reference to them, so they go as
            # soon as this process drops the version, whatever became of the handle.
            data = await asyncio.to_thread(serialize_named_tensors, held.named())
            answer: dict[str, Any] = {"serialized_named_tensors": [base64.b64encode(data).decode()]}
            if self._api_key:  # the rollout relays only bytes this process signed
                answer["signatures"] = [sign_bytes(self._api_key, handle_message(version, data))]
            return JSONResponse(answer)

        @app.post("/groups")
        async def open_group(request: Request) -> JSONResponse:
            body = await request.json()
            try:
                name = str(body.get("group_name") or DEFAULT_GROUP_NAME)
                answer = await asyncio.to_thread(
                    self.open_group, name, int(body["world_size"]), str(body.get("backend", "gloo"))
                )
            except (WeightTransferError, KeyError, ValueError, TypeError) as exc:
                return JSONResponse(
                    {"error": f"cannot open the weight group: {exc}"}, status_code=400
                )
            return JSONResponse(answer)

        @app.get("/groups/{name}")
        async def group_state(name: str) -> dict[str, Any]:
            return {"state": self.group_state(name)}

        @app.post("/groups/{name}/broadcast")
        async def broadcast(name: str, request: Request) -> JSONResponse:
            body = await request.json()
            try:
                await asyncio.to_thread(
                    self.broadcast, name, int(body["version"]), int(body["bucket"])
                )
            except (WeightTransferError, KeyError, ValueError, TypeError) as exc:
                return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
            return JSONResponse({"success": True, "message": "sent"})

        @app.delete("/groups/{name}")
        async def close_group(name: str) -> dict[str, Any]:
            await asyncio.to_thread(self.close_group, name)
            return {"success": True}

        return app
