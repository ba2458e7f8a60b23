"""How the rollout role moves its inference servers to a committed version.

Fetch first, while generation goes on (`stage`): one local copy every server reads, or
with Ray server actors a copy on each actor's node. Then `load`: a full version through
``/update_weights_from_disk``, or without files when `servers.weight_transfer` gives a
fast path (tasks/rollout/transfer.py: nothing is fetched, and a version the fast path
fails to deliver is fetched and loaded from disk then); a LoRA run's adapter version
through SGLang's LoRA API
(``/load_lora_adapter``, then every request names it in ``lora_path``), which Sluice's
server speaks too. A LoRA run's servers start on its base (version 0), and an adapter is
loaded only once its recorded base digest is the one they were started on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from sluice.engines.policy.adapter import BASE_REFERENCE_FILE
from sluice.infra.checkpoints import read_manifest
from sluice.infra.config.run import RunConfig
from sluice.infra.registry import CommittedVersion
from sluice.infra.serving.client import InferenceClient, InferenceServerUnreachableError
from sluice.infra.serving.versions import label_identity, update_label
from sluice.tasks.process.ray_servers import RayServerLost, ServerActors
from sluice.tasks.rollout.stats import RolloutStats
from sluice.tasks.rollout.transfer import FastPathFailed, FastWeights
from sluice.tasks.run.paths import read_json
from sluice.tasks.run.versions import check_base, fetch_update

log = logging.getLogger("sluice.rollout")


class ServedWeights:
    """Where each version's weights are staged, and how servers load them."""

    def __init__(
        self,
        config: RunConfig,
        cache_dir: Path,
        stats: RolloutStats | None = None,
        run_over: Callable[[], bool] = lambda: False,
    ) -> None:
        self.config = config
        self.cache_dir = cache_dir
        self.stats = stats or RolloutStats()
        self.run_over = run_over
        """Whether the run has ended (its done marker): a version the fast path can no
        longer deliver then is not worth loading from disk."""
        self.fast: FastWeights | None = None
        """The fast path full versions take, once the servers are known (None: disk)."""
        self.actors: ServerActors | None = None  # servers.launch=ray: the server actors
        self.base_digest: str | None = None
        """Digest of the version the servers were started on (a LoRA run's base)."""
        self.adapters: list[int] = []
        """Adapter versions loaded on every server, oldest first."""
        self.served: tuple[int, int] | None = None
        """The (incarnation, step) every server last took, as its label named it: a
        server takes only an update newer in that order (infra/serving/versions.py)."""

    def is_adapter(self, version: CommittedVersion) -> bool:
        """Whether `version` is published as an adapter on the base (a LoRA run's v1+)."""
        return bool(self.config.trainer.lora.rank) and version.policy_version > 0

    def fetch(self, version: CommittedVersion) -> Path:
        # One digest-keyed cache for every version; keep the served weights and the next.
        # Absolute: a server in another process or container resolves no relative path.
        return fetch_update(self.config, version, self.cache_dir, keep_latest=2).resolve()

    def start(self, version: CommittedVersion) -> Path:
        """`version`, the one the servers start on, on local disk."""
        self.base_digest = read_manifest(version.checkpoint_uri, self.config.storage.options).digest
        self.served = version.identity
        return self.fetch(version)

    def check(self, version: CommittedVersion) -> None:
        """Refuse an adapter trained on another base than the servers hold (one line)."""
        if not self.is_adapter(version) or self.base_digest is None:
            return
        where = f"{version.checkpoint_uri}/{BASE_REFERENCE_FILE}"
        reference = read_json(self.config, where) or {"base_uri": "?", "base_digest": "none"}
        check_base(
            reference,
            self.base_digest,
            f"policy version {version.policy_version}'s adapter",
            "the base the inference servers were started on",
        )

    async def stage(self, version: CommittedVersion) -> dict[str | None, str]:
        """`version`'s weights where the servers read them: per server URL, a path on
        that server's node (Ray actors), or one local path for every server (None).
        Nothing (empty) when a fast path is to bring them."""
        await asyncio.to_thread(self.check, version)
        if self.fast is not None and not self.fast.given_up and not self.is_adapter(version):
            return {}
        return await self.stage_files(version)

    async def stage_files(self, version: CommittedVersion) -> dict[str | None, str]:
        """`stage` from the checkpoint files, whatever the configured path."""
        if self.actors is not None:
            actors = self.actors
            try:
                return dict(await asyncio.to_thread(actors.prefetch, version))
            except RayServerLost as exc:
                raise InferenceServerUnreachableError(exc.url, str(exc)) from exc
        return {None: str(await asyncio.to_thread(self.fetch, version))}

    async def load(
        self,
        client: InferenceClient,
        staged: dict[str | None, str],
        version: CommittedVersion,
        urls: list[str] | None = None,
    ) -> bool:
        """Every server of `urls` (all) loads `version` from where `stage` put it."""
        number, adapter = version.policy_version, self.is_adapter(version)
        targets = urls if urls is not None else client.base_urls
        # A lineage reset goes back to an older durable version: its label then names
        # an incarnation above the served one, so the servers take it as the newer state.
        label = update_label(version.identity, self.served)
        if not staged and self.fast is not None and urls is None:
            try:
                self.stats.weight_bytes_moved += await self.fast.load(client, number, label)
                client.use_adapter(None)
                self.served = label_identity(label)
                return True
            except FastPathFailed as exc:
                if await asyncio.to_thread(self.run_over):  # the trainer is done and gone
                    log.info("policy version %d not loaded: the run is over (%s)", number, exc)
                    return False
                if not version.durable:  # servable only: its weights were in the sender
                    # A sender gone with its trainer is no fault of the path: not counted.
                    log.warning(
                        "policy version %s not loaded: %s, and it is not durable (the next "
                        "poll takes the newest servable version)",
                        version.name,
                        exc,
                    )
                    return False
                self.fast.count_failure()
                self.stats.weight_fallbacks += 1
                log.warning("policy version %d loads from disk: %s", number, exc)
                staged = await self.stage_files(version)
        if adapter and urls is None:
            # SGLang keeps loaded adapters until told: the one in use stays (requests in
            # flight name it) beside the new one, and older ones go.
            for old in self.adapters[:-1]:
                await client.unload_lora_adapter(old)
            self.adapters = self.adapters[-1:]

        async def one(path: str, where: list[str] | None) -> None:
            if not adapter:
                await client.update_weights_from_disk(path, number, urls=where, label=label)
                return
            await client.unload_lora_adapter(number, urls=where)  # a server that had it
            await client.load_lora_adapter(path, number, urls=where)

        if None in staged:
            await one(staged[None], urls)
        else:
            await asyncio.gather(*(one(staged[url], [url]) for url in targets))
        if urls is None:  # every server holds it now: requests go to it
            self.served = label_identity(label)
            self.adapters = [*self.adapters, number] if adapter else []
            client.use_adapter(number if adapter else None)
        return True
