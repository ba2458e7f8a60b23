"""The rollout role's side of the fast weight paths (`servers.weight_transfer`).

The registry decides which version the servers load (the alias, under the staleness
bound: tasks/rollout/role.py); this module only moves the bytes of a version the registry has
committed, from the trainer's sender (tasks/train/sender.py) to every server:

- `shared_memory`: the sender's handles to its copy go in one
  ``/update_weights_from_tensor`` per server, which maps them (same host only).
- `distributed`: a weight group (the sender rank 0, server i rank i + 1) is formed once
  and kept; each version goes bucket by bucket, the sender broadcasting while every
  server receives (``/update_weights_from_distributed``). A server stages the buckets
  and swaps the version in at the last.

The sender's document on storage and its handle answers are signed with the run's token
(infra/serving/auth.py): the rollout calls the sender's URL, sending it the token, and
relays its bytes to the servers only once the signature is the run's; anyone else who
can write the bucket gets one refusing line and the version loads from disk.

Anything that goes wrong (the trainer restarted and no longer holds the version, a
server or the trainer died mid-broadcast, a group that will not form) raises
`FastPathFailed` naming the cause; the caller loads that version from disk and the next
version tries the fast path again (a dropped group is formed anew).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from sluice.infra.config.run import RunConfig
from sluice.infra.serving.auth import (
    CredentialError,
    bearer_headers,
    verify_bytes,
    verify_document,
)
from sluice.infra.serving.client import InferenceClient, InferenceServerError
from sluice.tasks.run.control import SENDER_FILE
from sluice.tasks.run.credential import handle_message, run_token
from sluice.tasks.run.paths import read_json, run_paths

log = logging.getLogger("sluice.rollout")

GROUP_NAME = "sluice_weights"
"""The weight group's name on every server."""
GIVE_UP_AFTER = 3
"""Versions in a row the fast path failed to deliver before the rollout role stops
trying (and says so once): a placement it cannot work in would otherwise cost every
version a deadline before its disk load."""


class FastPathFailed(RuntimeError):
    """A version could not take the fast path; the message says why (load it from disk)."""


class FastWeights:
    """Moves committed versions from the trainer's sender to the servers, without files."""

    def __init__(self, config: RunConfig, run_id: str, path: str, backend: str) -> None:
        self.config, self.run_id, self.path, self.backend = config, run_id, path, backend
        self.sender_url: str | None = None
        self.group_ready = False
        self.failures_in_a_row = 0
        self._token: str | None = None  # the run's, read on first use
        self._http = httpx.AsyncClient(timeout=config.servers.weight_group_timeout_s + 10.0)

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def token(self) -> str:
        if self._token is None:
            self._token = run_token(self.config, self.run_id)
        return self._token

    async def _sender(self) -> str:
        if self.sender_url is None:
            where = f"{run_paths(self.config, self.run_id).control}/{SENDER_FILE}"
            document = await asyncio.to_thread(read_json, self.config, where)
            self.sender_url = sender_url_of(document, where, lambda: self.token)
        return self.sender_url

    async def _call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        url = await self._sender()
        try:
            response = await self._http.request(
                method, url + route, json=body, headers=bearer_headers(self.token)
            )
        except httpx.HTTPError as exc:
            self.sender_url = None  # a restarted trainer writes a new one
            self.group_ready = False
            raise FastPathFailed(
                f"the trainer's weight sender at {url} did not answer: {exc!r}"
            ) from exc
        if response.status_code == 404:
            raise FastPathFailed(f"the trainer's weight sender does not hold it ({route})")
        if not response.is_success:
            raise FastPathFailed(
                f"the trainer's weight sender answered {route} with {response.status_code}: {response.text[:300]}"
            )
        return response.json()

    @property
    def given_up(self) -> bool:
        return self.failures_in_a_row >= GIVE_UP_AFTER

    async def load(self, client: InferenceClient, version: int, label: str | None = None) -> int:
        """Every server of `client` serves `version` (labelled `label`: its (incarnation,
        step), infra/serving/versions.py) once this returns; the bytes moved (per server).
        FastPathFailed when the fast path cannot do it."""
        if self.given_up:
            raise FastPathFailed(f"the fast path failed {GIVE_UP_AFTER} versions in a row")
        moved = await self._load(client, version, label)
        self.failures_in_a_row = 0
        return moved

    def count_failure(self) -> None:
        """One more version in a row the fast path failed to deliver while the run goes
        on. (A failure once the trainer is done and gone is not the path's: the caller
        does not count it, or every run would end by giving the path up.)"""
        self.failures_in_a_row += 1
        if self.given_up:
            log.error(
                "the %s weight path failed %d versions in a row: every later version "
                "loads from disk", self.path, GIVE_UP_AFTER,
            )  # fmt: skip

    async def _load(self, client: InferenceClient, version: int, label: str | None) -> int:
        meta = await self._call("GET", f"/versions/{version}")
        try:
            if self.path == "shared_memory":
                for url in client.base_urls:  # handles of its own for each server
                    handles = await self._call("GET", f"/versions/{version}/handles")
                    await client.update_weights_from_tensor(
                        self.signed_handles(handles, version), version, url=url, label=label
                    )
            else:
                await self._ensure_group(client)
                await self._broadcast(client, version, meta, label)
        except InferenceServerError as exc:
            await self.drop_group(client)
            raise FastPathFailed(str(exc)) from exc
        return int(meta["bytes"])

    def signed_handles(self, answer: Any, version: int) -> list[str]:
        """The handles of a sender's answer, each checked against its signature: bytes a
        server would unpickle are relayed only when this run's sender made them."""
        handles = answer.get("serialized_named_tensors") if isinstance(answer, dict) else None
        signatures = answer.get("signatures") if isinstance(answer, dict) else None
        if not isinstance(handles, list) or not isinstance(signatures, list):
            raise FastPathFailed(f"the handles of version {version} carry no signature: refused")
        if len(handles) != len(signatures) or not all(
            isinstance(h, str)
            and verify_bytes(self.token, handle_message(version, _decoded(h)), sig)
            for h, sig in zip(handles, signatures, strict=False)
        ):
            raise FastPathFailed(
                f"the handles of version {version} are not signed with this run's credential: "
                "refused"
            )
        return handles

    async def _ensure_group(self, client: InferenceClient) -> None:
        if self.group_ready:
            return
        world_size = len(client.base_urls) + 1
        opened = await self._call(
            "POST",
            "/groups",
            {"group_name": GROUP_NAME, "world_size": world_size, "backend": self.backend},
        )
        started = time.monotonic()
        await client.init_weights_update_group(
            opened["master_address"], opened["master_port"], self.backend, GROUP_NAME
        )
        deadline = started + self.config.servers.weight_group_timeout_s
        while True:  # the servers have joined; the sender's side completes at once
            state = (await self._call("GET", f"/groups/{GROUP_NAME}"))["state"]
            if state == "ready":
                break
            if state != "forming" or time.monotonic() > deadline:
                await self.drop_group(client)
                raise FastPathFailed(f"the weight group did not form: {state}")
            await asyncio.sleep(0.02)
        self.group_ready = True
        log.info(
            "weight group formed with %d servers (%s) in %.2f s",
            len(client.base_urls),
            self.backend,
            time.monotonic() - started,
        )

    async def _broadcast(
        self, client: InferenceClient, version: int, meta: dict[str, Any], label: str | None
    ) -> None:
        for index, bucket in enumerate(meta["buckets"]):
            names = [meta["names"][i] for i in bucket]
            dtypes = [meta["dtypes"][i] for i in bucket]
            shapes = [meta["shapes"][i] for i in bucket]
            send = asyncio.create_task(
                self._call(
                    "POST", f"/groups/{GROUP_NAME}/broadcast", {"version": version, "bucket": index}
                )
            )
            receive = asyncio.create_task(
                client.update_weights_from_distributed(
                    names, dtypes, shapes, version, GROUP_NAME, label
                )
            )
            results = await asyncio.gather(send, receive, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                await self.drop_group(client)
                raise FastPathFailed(
                    f"bucket {index} of version {version}: {failed[0]}"
                ) from failed[0]

    async def drop_group(self, client: InferenceClient) -> None:
        """Leave the group on both sides (best effort); the next version forms a new one."""
        self.group_ready = False
        if self.path != "distributed":
            return
        await client.destroy_weights_update_group(GROUP_NAME)
        with contextlib.suppress(FastPathFailed):
            await self._call("DELETE", f"/groups/{GROUP_NAME}")


def sender_url_of(document: Any, where: str, token: Callable[[], str]) -> str:
    """The URL the sender document read at `where` names, once its signature is the
    run's (`token()`): before the URL is trusted with the token, or its bytes relayed."""
    if not isinstance(document, dict) or not document.get("url"):
        raise FastPathFailed("the trainer has not published its weight sender yet")
    try:
        verify_document(token(), document, f"the weight sender document {where}")
    except CredentialError as exc:
        raise FastPathFailed(str(exc)) from exc
    return str(document["url"])


def _decoded(handle: str) -> bytes:
    try:
        return base64.b64decode(handle, validate=True)
    except (binascii.Error, ValueError):
        return b""
