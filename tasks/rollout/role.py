"""The rollout role: generate prompt groups continuously, under the staleness gate.

Loop (docs/design.md §1–2):
- the staleness gate says how many prompt groups may start now (floor(n/B) <= i + η,
  i = newest committed policy version, n counted over the whole run);
- each group is G samples of one prompt, sent to the inference servers through the
  SGLang-compatible client; a finished group becomes one shard of the `rollouts`
  stream, keyed by its group index so a retried write never duplicates it; group n
  samples with the synchronous loop's seeds for group n, and at η = 0 the groups of a
  batch go out as one request (one per server), so `mode: on_policy` does the same
  work as `sluice train --sync`;
- a poller watches the servable alias; a newer version is staged *before* generation is
  paused, then pause → update → continue (interruptible), or an update that drains first.

Resume: n is re-based from the stream; groups in flight when the role died go again with
the same index and prompt, and after a trainer restart so do those holding lost tokens.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import time
import uuid

import pyarrow as pa

from sluice.engines.rl.groups import (
    reissue_plan,
    resume_gate,
)
from sluice.engines.rl.lineage import LostAfter
from sluice.engines.rl.staleness import StalenessGate
from sluice.engines.trajectory import POLICY_INCARNATION, TrajectoryRow
from sluice.infra.checkpoints import CheckpointIncomplete
from sluice.infra.config.run import RunConfig
from sluice.infra.config.servers import servers_on_gpu, weight_transfer_path
from sluice.infra.registry import CommittedVersion
from sluice.infra.serving import protocol
from sluice.infra.serving.client import (
    InferenceClient,
    InferenceServerUnreachableError,
)
from sluice.infra.streams.schema import table_from_rows
from sluice.tasks.process.inference_server import EmbeddedServer, embedded_server, run_client
from sluice.tasks.process.ray_servers import ServerActors
from sluice.tasks.prompts import PromptSource
from sluice.tasks.role import Role
from sluice.tasks.rollout.groups import WrittenGroups, request_groups
from sluice.tasks.rollout.refill import UninformativeGroups
from sluice.tasks.rollout.sampling import GroupSampler
from sluice.tasks.rollout.stats import RolloutStats
from sluice.tasks.rollout.transfer import FastWeights
from sluice.tasks.rollout.weights import ServedWeights
from sluice.tasks.run.credential import verified_server_urls
from sluice.tasks.run.paths import ROLLOUTS, SCORED
from sluice.tasks.run.state_timer import OTHER
from sluice.tasks.run.versions import lost_versions, serving_start, superseded
from sluice.tasks.tool_runner import Shaping, ToolBox, episode_spec

log = logging.getLogger("sluice.rollout")
FIRST_VERSION_TIMEOUT_S = 600.0
"""How long the rollout role waits for policy version 0 before it gives up."""
PROFILE_INTERVAL_S = 10.0
"""How often the servers' measured step costs are read into the role's status."""
PROFILE_READ_TIMEOUT_S = 5.0
"""Longest a read of the step costs may take (a silent server must not hold the role)."""


class RolloutRole(Role):
    """State of one rollout role process; `server` is an embedded server already starting
    (`sluice.tasks.process.inference_server.start_early`), stopped if the role fails to start."""

    name = "rollout"

    @property
    def poll_interval_s(self) -> float:
        return self.config.rollout.poll_interval_s

    def __init__(
        self,
        config: RunConfig,
        run_id: str,
        mlflow_run_id: str,
        server: EmbeddedServer | None = None,
    ):
        self.server = server
        # Set once the servers are known: whether a server that stops answering is waited
        # for (servers the role does not own) and for how long.
        self.recoverable = False
        self.health_timeout_s = 300.0
        try:
            super().__init__(config, run_id, mlflow_run_id)
            self.stats = RolloutStats()
            self.weights = ServedWeights(
                config,
                self.local_dir("rollout-weights"),
                self.stats,
                run_over=lambda: self.control.done_marker() is not None,
            )
            self.writer = self.stream_writer(ROLLOUTS, writer_id=f"rollout-{os.getpid()}")
            self.prompts = PromptSource(config)
        except BaseException:
            self.stop_server()
            raise
        self.current: CommittedVersion | None = None
        self.lost: LostAfter = {}
        """The registry's lost versions, as of the newest lineage reset seen."""
        self.groups = WrittenGroups(self.stream_reader(ROLLOUTS, consumer="rollout-rebase"))
        self.sampler = GroupSampler(
            config, self.prompts, self.writer.writer_id, lambda: self.served_version
        )

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def run(self) -> None:
        log.info(
            "rollout %s starting (η=%d, interruptible=%s)",
            uuid.uuid4().hex[:6],
            self.config.staleness.max_staleness,
            self.config.rollout.interruptible,
        )
        try:
            asyncio.run(self.generate())
        finally:
            if self.sampler.toolbox is not None:
                self.sampler.toolbox.close()
            self.stop_server()

    # ------------------------------------------------------------ weights

    async def maybe_update_weights(self, client: InferenceClient) -> bool:
        """Serve the newest servable version if it moved; returns whether the lineage was
        reset (a new trainer incarnation, or the alias back on an older durable version
        after a crash: the versions served since are lost)."""
        latest = await asyncio.to_thread(self.registry.newest_servable)
        current = self.current
        if latest is None or current is None or latest.identity == current.identity:
            return False
        reset = latest.identity < current.identity or (
            latest.incarnation != current.incarnation
            and await asyncio.to_thread(self.was_lost, current)
        )
        # The loop's time from here is the reload's, though the fetch overlaps generation.
        self.stats.timer.enter("reload")
        # Fetch before pausing: generation keeps running while the bytes move.
        try:
            staged = await self.weights.stage(latest)
        except CheckpointIncomplete:
            if latest.durable and not await asyncio.to_thread(superseded, self.registry, latest):
                raise
            # Retention let it go meanwhile, or it is servable only and its files were
            # never written: the next poll takes the newer one.
            return False
        started = time.monotonic()
        if self.config.rollout.interruptible:
            await client.pause(self.config.rollout.pause_mode)
            try:
                served = await self.weights.load(client, staged, latest)
            finally:
                await client.continue_()
        else:  # wait-for-drain baseline: the server finishes in-flight requests first
            served = await self.weights.load(client, staged, latest)
        if not served:
            return False
        self.stats.update_time_s += time.monotonic() - started
        self.stats.weight_updates += 1
        self.stats.commit_to_served_s.append(time.time() - latest.created_at_ms / 1000)
        log.info(
            "weights -> policy version %d (%.2fs)",
            latest.policy_version,
            time.monotonic() - started,
        )
        self.current = latest
        return reset

    async def after_reset(
        self, gate: StalenessGate, next_index: int, flying: set[int]
    ) -> list[int]:
        """The trainer restarted behind what the servers held (docs/design.md §2): the
        groups written with tokens of the versions it lost no longer count; the gate is
        re-based on the version served now and every number below the high-water mark
        that is neither written nor in flight goes again (a new attempt). Returns those
        numbers, smallest first."""
        assert self.current is not None
        self.lost = lost_versions(await asyncio.to_thread(self.registry.versions))
        await asyncio.to_thread(self.groups.scan, self.lost)
        written, version = self.groups.written, self.current.policy_version
        B = self.config.trainer.prompts_per_batch
        gate.rebase(version, len(written), min(len(written), version * B))
        dropped = self.groups.dropped - flying
        self.stats.groups_lineage_dropped = self.groups.lost_shards
        log.warning(
            "the trainer restarted from %s: %d written groups hold tokens of versions it "
            "lost and go again; groups in flight on the old weights are dropped as they end",
            self.current.name,
            len(dropped),
        )
        return sorted(set(range(next_index)) - written - flying)

    def was_lost(self, version: CommittedVersion) -> bool:
        """Whether the registry now marks `version` lost (a trainer restarted behind it)."""
        now = self.registry.get(version.policy_version, incarnation=version.incarnation)
        return now is not None and now.lost

    def holds_lost_tokens(self, rows: list[TrajectoryRow], incarnation: int) -> bool:
        """Whether a finished group must go again: it started on another trainer
        incarnation's weights than the servers hold now (its tokens would be named by
        one incarnation; version 0, the run's initial weights, is never lost), or holds
        a token of a version that incarnation lost."""
        if incarnation < 0 or (
            self.current is not None and incarnation not in (0, self.current.incarnation)
        ):
            return True
        after = self.lost.get(incarnation)
        return after is not None and any(row.version_end > after for row in rows)

    def start_fast_path(self, client: InferenceClient) -> None:
        """Full versions take `servers.weight_transfer`'s path from now on (not disk)."""
        cfg = self.config
        path = weight_transfer_path(cfg)
        self.stats.weight_path = path
        if path == "disk":
            return
        backend = "nccl" if servers_on_gpu(cfg) else "gloo"
        self.weights.fast = FastWeights(cfg, self.run_id, path, backend)
        log.info("full policy versions reach the servers over %s (%s)", path, backend)

    # ------------------------------------------------------------ groups

    @property
    def served_version(self) -> int:
        """The policy version the servers hold now (0 before the first is known)."""
        return self.current.policy_version if self.current else 0

    async def generate_groups(
        self, client: InferenceClient, indices: list[int]
    ) -> list[list[TrajectoryRow]]:
        """The rows of prompt groups `indices`, one list per group, in one request."""
        return await self.sampler.groups(client, indices)

    def write_group(self, index: int, rows: list[TrajectoryRow], incarnation: int) -> None:
        """Write group `index`, sampled by versions of trainer `incarnation` only."""
        table = table_from_rows(rows, stream=ROLLOUTS)
        column = table.schema.get_field_index(POLICY_INCARNATION)
        table = table.set_column(
            column,
            table.schema.field(column),
            pa.array([incarnation] * table.num_rows, pa.int32()),
        )
        self.writer.write(table, shard_key=self.groups.key(index))
        self.groups.wrote(index)
        self.stats.record_group(rows)

    # ------------------------------------------------------------ main loop

    async def generate(self) -> None:
        cfg = self.config
        first = self.wait_for_first_version(timeout_s=FIRST_VERSION_TIMEOUT_S)
        # Servers start on the newest version, or a LoRA run's base: adapters go on it.
        self.current = serving_start(cfg, self.registry) or first
        local = await asyncio.to_thread(self.weights.start, self.current)
        # A prompt must leave the engine room for at least one token.
        tokenizer = self.prompts.use_policy(local).tokenizer
        assert tokenizer is not None
        if cfg.episode.tools:
            self.sampler.episodes = episode_spec(cfg, tokenizer)
            self.sampler.toolbox = ToolBox.for_run(cfg)
            self.sampler.shaping = Shaping(cfg.episode.shaping)
        early = self.server
        if early is not None and early.weight_version != self.current.policy_version:
            # Started from the flow's start document; the registry moved on since.
            log.info("early server holds version %d; restarting", early.weight_version)
            self.stop_server()
        launched = cfg.servers.launch != "embedded"
        if cfg.servers.launch == "ray":
            actors = self.weights.actors = ServerActors(cfg, self.run_id)
            urls = await asyncio.to_thread(
                actors.wait, cfg.servers.start_timeout_s, self.control.should_stop
            )
        elif launched:
            urls = verified_server_urls(cfg, self.run_id)  # signed: they get the token
        else:
            urls = list(cfg.rollout.server_urls)
        external = bool(urls)
        if urls and cfg.rollout.weight_noise_std:
            # An external server loads clean weights; running on would measure no
            # injected mismatch while the config claims some.
            raise ValueError(
                "rollout.weight_noise_std is applied by the embedded inference server only; "
                "unset rollout.server_urls or set rollout.weight_noise_std=0"
            )
        if not urls and self.server is not None:
            urls = [self.server.url]
        elif not urls:
            self.server = embedded_server(cfg, self.run_id, local, self.current.policy_version)
            urls = [self.server.url]
        client = run_client(cfg, self.run_id, urls, cfg.rollout.request_timeout_s)
        # Launched containers may still be starting (an image to unpack, a model to load).
        self.health_timeout_s = cfg.servers.start_timeout_s if launched else 300.0
        try:
            await client.wait_until_healthy(timeout_s=self.health_timeout_s)
            if external:  # external servers start from whatever they hold
                await self.weights.load(
                    client, await self.weights.stage_files(self.current), self.current
                )
            self.start_fast_path(client)
            self.recoverable = external
            await self._loop(client)
        finally:
            if self.weights.fast is not None:
                await self.weights.fast.aclose()
            await client.aclose()

    async def _loop(self, client: InferenceClient) -> None:
        cfg = self.config
        self.lost = lost_versions(await asyncio.to_thread(self.registry.versions))
        await asyncio.to_thread(self.groups.scan, self.lost)
        self.stats.groups_lineage_dropped = self.groups.lost_shards
        written = self.groups.written
        next_index, reissue = reissue_plan(written)
        # Re-based from durable state, so a restart never bursts past the bound.
        gate = resume_gate(
            len(written),
            self.current.policy_version if self.current else 0,
            cfg.trainer.prompts_per_batch,
            cfg.staleness.max_staleness,
        )
        refill = (
            UninformativeGroups(self.stream_reader(SCORED, consumer="rollout-refill"))
            if cfg.trainer.dynamic_sampling
            else None
        )
        if refill is not None:  # their slots were given back before the restart too
            gate.release(await asyncio.to_thread(refill.poll))
        if reissue:
            log.info("re-issuing %d groups that were in flight before the restart", len(reissue))
        max_in_flight = max(1, (2 * cfg.rollout.max_batch_size) // cfg.rollout.group_size)
        # eta = 0 (`mode: on_policy`): the trainer waits for the whole batch anyway, so the
        # groups admitted together go out together, one request per server; with one
        # server a batch is one request, computed as the synchronous loop computes it.
        one_request = cfg.staleness.max_staleness == 0 and self.sampler.episodes is None
        if one_request:
            max_in_flight = max(max_in_flight, cfg.trainer.prompts_per_batch)
        # Each request: the (issue number, gate ticket) of the groups it samples.
        in_flight: dict[asyncio.Task[list[list[TrajectoryRow]]], list[tuple[int, int]]] = {}
        started_in: dict[asyncio.Task[list[list[TrajectoryRow]]], int] = {}
        """The trainer incarnation whose weights each request started on."""
        tainted: set[asyncio.Task[list[list[TrajectoryRow]]]] = set()
        """Requests in flight when the lineage was reset."""
        last_poll = last_profile = 0.0
        while not self.control.should_stop():
            self.stats.timer.enter(OTHER)  # polls and bookkeeping, until a state is named
            now = time.monotonic()
            if now - last_poll >= cfg.rollout.poll_interval_s:
                last_poll = now
                self.stats.timer.enter("poll")  # `reload` once a newer version is found
                try:
                    if await self.maybe_update_weights(client):
                        flying = {i for groups in in_flight.values() for i, _ in groups}
                        reissue = await self.after_reset(gate, next_index, flying)
                        tainted.update(in_flight)  # they ran on lost weights: dropped
                except InferenceServerUnreachableError as exc:
                    await self.recover_servers(client, exc)
                self.stats.timer.enter("poll")
                if refill is not None:
                    released = await asyncio.to_thread(refill.poll)
                    gate.release(released)
                    self.stats.groups_refilled += released
                self.stats.timer.enter(OTHER)
            if now - last_profile >= PROFILE_INTERVAL_S:
                last_profile = now
                await self.read_profiles(client)
            version = self.current.policy_version if self.current else 0
            admitted: list[tuple[int, int]] = []
            while sum(map(len, in_flight.values())) + len(admitted) < max_in_flight:
                ticket = gate.try_start(version)
                if ticket is None:
                    break
                if reissue:
                    index = reissue.pop(0)
                else:
                    index, next_index = next_index, next_index + 1
                admitted.append((index, ticket))
            for groups in request_groups(admitted, one_request, len(client.base_urls)):
                task = asyncio.create_task(self.generate_groups(client, [i for i, _ in groups]))
                in_flight[task] = groups
                started_in[task] = self.current.incarnation if self.current else 0
            if not in_flight:
                self.stats.timer.enter("idle")
                await asyncio.sleep(0.05)
                self._report(gate, version)
                continue
            self.stats.timer.enter("generate")
            finished, _ = await asyncio.wait(
                in_flight, timeout=0.05, return_when=asyncio.FIRST_COMPLETED
            )
            self.stats.timer.enter(OTHER)
            lost: InferenceServerUnreachableError | None = None
            outcomes: list[tuple[int, int, list[TrajectoryRow] | None, int]] = []
            for task in finished:
                groups, incarnation = in_flight.pop(task), started_in.pop(task)
                if task in tainted:
                    tainted.discard(task)
                    incarnation = -1  # matches no incarnation: its groups go again
                results: list[list[TrajectoryRow] | None] = [None] * len(groups)
                try:
                    results = list(task.result())
                except InferenceServerUnreachableError as exc:
                    lost = exc  # its server went away: its groups go again, like an abort
                outcomes += [
                    (i, t, rows, incarnation) for (i, t), rows in zip(groups, results, strict=True)
                ]
            for index, ticket, rows, incarnation in outcomes:
                if rows is not None and self.holds_lost_tokens(rows, incarnation):
                    self.stats.groups_lineage_dropped += 1
                    rows = None  # sampled partly by lost weights: it goes again
                if rows is None or any(r.finish_reason == "abort" for r in rows):
                    gate.abandon(ticket)  # aborted by a weight update: free the slot, ask again
                    # Kept sorted: the smallest issue number goes first, so every group's
                    # number stays below its admission position and batch floor(n/B)
                    # never trains it more than eta versions late.
                    bisect.insort(reissue, index)
                    continue
                if incarnation == 0 and self.current is not None:  # began on version 0
                    incarnation = self.current.incarnation
                with self.stats.timer.state("write"):
                    await asyncio.to_thread(self.write_group, index, rows, incarnation)
                gate.finish(ticket)
            if lost is not None:
                await self.recover_servers(client, lost)
            self._report(gate, version)
        for task in in_flight:
            task.cancel()
        await self.read_profiles(client)
        self.status.update(force=True, state="stopped", **self.stats.as_status())

    async def read_profiles(self, client: InferenceClient) -> None:
        await self.stats.read_servers(client, PROFILE_READ_TIMEOUT_S)

    async def recover_servers(
        self, client: InferenceClient, error: InferenceServerUnreachableError
    ) -> None:
        """A server stopped answering. Servers this role does not own (launched
        containers, which the flow restarts, or external ones) get `health_timeout_s` to
        answer again; then any pause a failed weight update left is released, and every
        server not holding the served version (a restarted one starts from the run's first
        weights) loads it. The role's own embedded server is not restarted: it fails."""
        if not self.recoverable:
            raise error
        self.stats.server_recoveries += 1
        log.warning(
            "%s; waiting up to %.0f s for the servers to answer", error, self.health_timeout_s
        )
        deadline = time.monotonic() + self.health_timeout_s
        while not all((await client.health()).values()):
            actors = self.weights.actors
            if actors is not None:  # a server started again answers elsewhere
                client.set_urls(await asyncio.to_thread(actors.read))
            if self.control.should_stop():
                return  # the run ended (its servers go with it): nothing to recover
            if time.monotonic() > deadline:
                raise error
            await asyncio.sleep(1.0)
        await client.continue_()
        served = protocol.version_label(self.current.policy_version) if self.current else None
        info = await client.model_info()
        stale = [url for url, answer in info.items() if answer.get("weight_version") != served]
        if self.weights.fast is not None:  # a restarted server left the weight group
            await self.weights.fast.drop_group(client)
        if stale and self.current is not None and not self.current.durable:
            raise error  # its weights are in the sender only: restart from a durable one
        if stale and self.current is not None:
            staged = await self.weights.stage_files(self.current)
            await self.weights.load(client, staged, self.current, urls=stale)
        log.info(
            "servers answer again; %d reloaded policy version %s",
            len(stale), self.current.policy_version if self.current else "-",
        )  # fmt: skip

    def _report(self, gate: StalenessGate, version: int) -> None:
        self.status.update(
            state="running",
            policy_version=version,
            groups_accepted=gate.accepted,
            groups_in_flight=gate.in_flight,
            prompts_skipped_too_long=self.prompts.skipped_too_long,
            prompts_skipped_by_curriculum=self.prompts.skipped_by_curriculum,
            shaping_failures=self.sampler.shaping.failures,
            **self.stats.as_status(),
        )
