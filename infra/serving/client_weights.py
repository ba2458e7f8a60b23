"""The weight-transfer calls of `InferenceClient` (infra/serving/client.py): a weight
group formed with the trainer's sender, the buckets it broadcasts, and tensor handles
mapped on the server's host.

Kept apart from the generation client: the rollout role alone uses these, on the fast
weight paths (tasks/rollout/transfer.py), and both halves stay small enough to read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sluice.infra.serving import protocol
from sluice.infra.serving.errors import InferenceServerError


class WeightGroupCalls:
    """SGLang's weight-transfer routes over every server of the client."""

    base_urls: list[str]

    if TYPE_CHECKING:  # InferenceClient's own

        async def _request(
            self, url: str, method: str, path: str, body: Mapping[str, Any] | None = None
        ) -> Any: ...

        async def _broadcast(
            self,
            method: str,
            path: str,
            body: Mapping[str, Any] | None = None,
            urls: Sequence[str] | None = None,
        ) -> dict[str, Any]: ...

    def _check_answers(self, answers: dict[str, Any], what: str) -> None:
        for url, answer in answers.items():
            if not isinstance(answer, dict) or not answer.get("success"):
                message = answer.get("message") if isinstance(answer, dict) else answer
                raise InferenceServerError(
                    url, f"inference server {url} failed to {what}: {message}"
                )

    async def init_weights_update_group(
        self, master_address: str, master_port: int, backend: str, group_name: str
    ) -> None:
        """Every server joins the weight group hosted by rank 0 at
        ``master_address:master_port``: server i as rank i + 1 of ``len(base_urls) + 1``
        (SGLang's ``/init_weights_update_group``). Returns once every server has joined."""
        world_size = len(self.base_urls) + 1

        async def join(index: int, url: str) -> Any:
            body = {
                "master_address": master_address, "master_port": int(master_port),
                "rank_offset": index + 1, "world_size": world_size,
                "group_name": group_name, "backend": backend,
            }  # fmt: skip
            try:
                return await self._request(url, "POST", protocol.INIT_WEIGHTS_UPDATE_GROUP, body)
            except InferenceServerError as exc:
                return {"success": False, "message": str(exc)}

        answers = await asyncio.gather(*(join(i, u) for i, u in enumerate(self.base_urls)))
        self._check_answers(
            dict(zip(self.base_urls, answers, strict=True)), "join the weight group"
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Every server leaves the weight group (best effort: a server without it is fine)."""
        await asyncio.gather(
            *(
                self._request(
                    url, "POST", protocol.DESTROY_WEIGHTS_UPDATE_GROUP, {"group_name": group_name}
                )
                for url in self.base_urls
            ),
            return_exceptions=True,
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        version: int,
        group_name: str,
        label: str | None = None,
    ) -> None:
        """Every server receives one flattened bucket broadcast by rank 0 of the weight
        group (SGLang's ``/update_weights_from_distributed``); a version sent in several
        buckets is served once the last has arrived."""
        body = {
            "names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "weight_version": label or protocol.version_label(int(version)),
            "load_format": "flattened_bucket",
        }  # fmt: skip
        answers = await self._broadcast("POST", protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body)
        self._check_answers(answers, f"receive policy version {version}")

    async def update_weights_from_tensor(
        self, serialized: Sequence[str], version: int, *, url: str, label: str | None = None
    ) -> None:
        """Server ``url`` maps the tensors ``serialized`` (base64 handles to shared memory
        or CUDA IPC on its host) as policy ``version`` (SGLang's
        ``/update_weights_from_tensor``). One server per call: a handle is mapped once."""
        body = {
            "serialized_named_tensors": list(serialized),
            "weight_version": label or protocol.version_label(int(version)),
        }
        answers = await self._broadcast("POST", protocol.UPDATE_WEIGHTS_FROM_TENSOR, body, [url])
        self._check_answers(answers, f"map policy version {version}")
