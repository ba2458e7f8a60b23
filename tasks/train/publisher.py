"""Publishing the train role's versions: servable at once, durable at the cadence.

docs/design.md §2: a version is *servable* once its weights can reach the servers and
*durable* once its weights, trainer state and consumed list are on storage, hashed and
committed. Per published version k the cadence (`tasks/run/cadence.py`,
`checkpoint.*`) says which:

- With ``checkpoint.every_versions: 1`` every version is durable and registered only
  then, the next publish waiting for the one before: the behaviour before the split.
- Otherwise every version is registered *servable* (``sluice.durable=pending``) as
  soon as its weights can reach the servers: in the sender (shared memory, CUDA IPC,
  a weight group), or, on the disk path, as policy files on storage. A due version is
  also snapshotted (weights and optimizer state, one copy to host memory) and made
  durable on its own thread while training goes on; a due version that finds the
  previous durable write still running skips durability (``skipped``), and training
  waits for storage only past ``checkpoint.max_lag_s`` or for a version that must be
  durable (the final one, a clean stop, one the evaluation schedule names).

Two background threads, so a slow store never holds up the servers: ``servable``
(offer, the disk path's policy files, registration) and ``durable`` (trainer state,
consumed list, the durable commit). Shards are acked once a durable version covers
them, on the role's own thread: the consumed list of durable version k names every
shard trained since the durable version before it, so a crash anywhere retrains
exactly what no durable version holds (`TrainRole.reconcile_ledger` acks the rest).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.engines.inference.loading import resolve_dtype
from sluice.engines.rl.trainer import PolicyTrainer
from sluice.infra.checkpoints import save_checkpoint
from sluice.infra.config.servers import weight_transfer_path
from sluice.infra.failpoints import failpoint
from sluice.infra.serving.auth import sign_document
from sluice.infra.streams.names import ShardRef
from sluice.tasks.process.ray_servers import private_address
from sluice.tasks.run.cadence import Decision, cadence_of, must_be_durable
from sluice.tasks.run.control import SENDER_FILE
from sluice.tasks.run.credential import run_token
from sluice.tasks.run.paths import write_json
from sluice.tasks.run.threads import Background
from sluice.tasks.run.versions import SavedVersion, save_version, save_version_later
from sluice.tasks.train.sender import WeightSender

if TYPE_CHECKING:
    from sluice.infra.streams.reader import StreamReader
    from sluice.tasks.train.base import TrainingRole

log = logging.getLogger("sluice.train")
Snapshot = tuple[SavedVersion, Callable[[], None] | None, dict[str, Any] | None]
"""A version's copy: where it is written, the write (None: written already, or nothing
to write), and the copied weights (None: not copied to host memory)."""


def tensor_bytes(state: dict[str, Any]) -> int:
    """Bytes of the tensors in a state dict (shared storage counted once)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}
    return sum(seen.values())


class Publisher:
    """Publishes one trainer incarnation's versions (see the module notes)."""

    def __init__(
        self, role: TrainingRole, reader: StreamReader, local_root: Path, start_version: int
    ) -> None:
        self.role, self.reader, self.local_root = role, reader, local_root
        self.config = role.config
        self.cadence = cadence_of(self.config, start_version, time.monotonic())
        self.copying = Background("trainer-copy")
        self.servable = Background("trainer-servable")
        self.durable = Background("trainer-durable")
        self.sender: WeightSender | None = None
        self._registered: dict[int, Future[Any]] = {}
        """Per servable version, its registration job (a durable commit waits for it)."""
        self._writing: Future[Any] | None = None
        self._unacked: list[tuple[int, list[ShardRef]]] = []
        """Shards each published version consumed, until a durable version covers them."""
        self._durable_done = start_version
        """The newest version made durable (set on the durable thread)."""
        self.newest_published = start_version
        self.newest_durable_published = start_version
        """The newest version whose durability was started (or done)."""
        self._durable_dir: Path | None = None
        """The local copy the newest durable job reads (kept from pruning)."""
        self.parts: dict[str, float] = {}
        """Seconds and bytes of each part of the newest publish and of the newest
        background jobs (``train/...``): written by the jobs' threads, read by the role's."""

    # ------------------------------------------------------------ sender

    def start_sender(self) -> None:
        """Offer published versions to the rollout over a fast path (shared memory or a
        weight group: `servers.weight_transfer`); its URL goes in the control dir."""
        cfg = self.config
        path = weight_transfer_path(cfg)
        if path == "disk":
            return
        token = run_token(cfg, self.role.run_id)  # asked of callers, signs what it sends
        self.sender = WeightSender(
            dtype=resolve_dtype(cfg.rollout.dtype),
            bucket_bytes=int(cfg.servers.weight_bucket_mb * 2**20),
            group_timeout_s=cfg.servers.weight_group_timeout_s,
            bind_host=private_address() if cfg.servers.launch == "ray" else "127.0.0.1",
            api_key=token,
        )
        url = self.sender.start()
        document = {"url": url, "pid": os.getpid(), "path": path, "started_at": time.time()}
        write_json(cfg, f"{self.role.paths.control}/{SENDER_FILE}", sign_document(token, document))
        log.info("policy versions are offered over %s at %s", path, url)

    def stop_sender(self) -> None:
        if self.sender is not None:
            self.sender.stop()
            self.sender = None

    def offer(self, version: int, state: dict[str, Any]) -> None:
        """Hold `version`'s weights in the sender, before it is registered (the rollout
        asks for a version only once the registry has it)."""
        if self.sender is None:
            return
        started = time.monotonic()
        held = self.sender.offer(version, state)
        self.parts["train/weight_offer_s"] = time.monotonic() - started
        self.parts["train/weight_offer_bytes"] = held

    # ------------------------------------------------------------ publishing

    @property
    def every_version_durable(self) -> bool:
        """`every_versions: 1`, and LoRA runs: an adapter is a few MB, durable at once."""
        return self.config.checkpoint.every_versions == 1 or bool(self.config.trainer.lora.rank)

    def publish(
        self,
        trainer: PolicyTrainer,
        version: int,
        consumed: list[ShardRef],
        tags: dict[str, Any],
        cursor: int | None = None,
        *,
        must: bool = False,
    ) -> Decision:
        """Publish the trainer's weights as `version` (it trained `consumed`); returns
        what the cadence made of it. `must`: make it durable whatever the cadence."""
        started = time.monotonic()
        self.parts = {}
        self.check()
        self.ack_durable()
        must = must or self.every_version_durable or must_be_durable(self.config, version)
        writing = self._writing is not None and not self._writing.done()
        decision = self.cadence.decide(version, started, must=must, writing=writing)
        if decision == "wait":
            self.durable.wait()
            self.check()
            self.ack_durable()
        waited = time.monotonic()
        self.parts["train/publish_wait_s"] = waited - started
        self._unacked.append((version, list(consumed)))
        if self.every_version_durable:
            self._publish_durable_only(trainer, version, tags, cursor)
        else:
            self._publish_servable(trainer, version, tags, cursor, decision)
        self.cadence.published(version, started, decision)
        self.newest_published = version
        if decision in ("durable", "wait"):
            self.newest_durable_published = version
        self.parts["train/durability_lag_s"] = self.cadence.lag_s(time.monotonic())
        self.parts["train/durability_skipped"] = float(self.cadence.skipped)
        return decision

    def _publish_durable_only(
        self, trainer: PolicyTrainer, version: int, tags: dict[str, Any], cursor: int | None
    ) -> None:
        """Every version durable, registered once it is (`every_versions: 1`)."""
        started = time.monotonic()
        local = self.local_root / f"v{version:06d}"
        deferred = (
            save_version_later(trainer, local, version)
            if self.config.trainer.background_save
            else None
        )
        if deferred is not None:
            self.parts["train/host_copy_s"] = time.monotonic() - started
        on_gpu = next(trainer.model.parameters()).is_cuda
        if deferred is None or on_gpu:
            self.offer(version, trainer.model.state_dict())  # a device copy on a GPU
        if deferred is None:
            saved, write = save_version(trainer, local, version), None
        else:
            saved, write, weights = deferred
            if self.sender is not None and not on_gpu:  # from the host copy, off the path
                self.durable.submit(self.offer, version, weights)
        self._writing = self.durable.submit(
            self._write_and_commit, (saved, write, None), True, version, tags, self._names(),
            cursor, None,
        )  # fmt: skip
        self.durable.submit(self._prune_local, saved.policy.parent, None)

    def _publish_servable(
        self,
        trainer: PolicyTrainer,
        version: int,
        tags: dict[str, Any],
        cursor: int | None,
        decision: Decision,
    ) -> None:
        """Register `version` servable now; snapshot it for durability if due.

        One copy of the live tensors: the snapshot (weights, and the optimizer state
        when it is to be durable) or the sender's own copy of the weights. On a CPU
        trainer that honours the update fence it runs on the copy thread while the next
        step's pi_prox, forward and backward read the same tensors, and the next
        optimizer step waits for it (``train/update_fence_wait_s``); otherwise it is
        made here, on the critical path (a device copy on a GPU)."""
        started = time.monotonic()
        durable = decision in ("durable", "wait")
        local = self.local_root / f"v{version:06d}"
        on_gpu = next(trainer.model.parameters()).is_cuda
        disk = self.sender is None
        if not disk and on_gpu:
            self.offer(version, trainer.model.state_dict())  # a device copy
        offer_live = not disk and not on_gpu and not durable
        # The RNG and step count as of this version, before the next step moves them.
        small = trainer.small_state() if durable and hasattr(trainer, "small_state") else None

        def snapshot() -> Snapshot:
            failpoint("train.copying")  # inside the update fence: the next step waits
            copied = time.monotonic()
            if offer_live:  # the sender's copy is the only one
                self.offer(version, trainer.model.state_dict())
                return SavedVersion(local / "policy", local / "trainer_state"), None, None
            deferred = None
            if self.config.trainer.background_save:
                deferred = save_version_later(
                    trainer, local, version, weights_only=not durable, small=small
                )
            if deferred is None:
                return save_version(trainer, local, version), None, None
            taken = time.monotonic() - copied
            saved, write, weights = deferred
            nbytes = float(tensor_bytes(weights) * (1 if not durable else 3))
            self.parts.update(
                {
                    "train/snapshot_s": taken,
                    "train/snapshot_bytes": nbytes,
                    "train/snapshot_gb_per_s": nbytes / 1e9 / max(taken, 1e-9),
                }
            )
            # The write (save_pretrained) drops tied names from its dict as it goes, on
            # another thread than the sender's offer: each gets its own mapping.
            return saved, write, dict(weights)

        overlap = not on_gpu and getattr(trainer, "supports_update_fence", False)
        copy: Future[Snapshot]
        if overlap:
            copy = self.copying.submit(snapshot)
            trainer.update_fence = copy.result
        else:
            copy = Future()
            copy.set_result(snapshot())
        self.parts["train/host_copy_s"] = time.monotonic() - started
        url = self.role.paths.checkpoint(version)
        tags = {**tags, "sluice.published_s": f"{time.time():.3f}"}
        offer_snapshot = not disk and not on_gpu and durable
        self._registered[version] = self.servable.submit(
            self._serve, copy, version, url, tags, disk, durable, offer_snapshot
        )
        if durable:
            names = self._names()
            self._writing = self.durable.submit(
                self._write_and_commit, copy, not disk, version, tags, names, cursor, url
            )
            self._durable_dir = local
        if durable or disk:  # local copies go once no job needs them
            self.servable.submit(self._prune_local, local, self._durable_dir)

    def _names(self) -> list[str]:
        """Every shard trained since the newest durable version (durable k's record)."""
        covered = self.newest_durable_published
        return [ref.name for version, refs in self._unacked if version > covered for ref in refs]

    # ------------------------------------------------------------ background jobs

    def _serve(
        self,
        copy: Future[Snapshot],
        version: int,
        url: str,
        tags: dict[str, Any],
        disk: bool,
        durable: bool,
        offer_snapshot: bool,
    ) -> None:
        """Make `version` reachable by the servers, then register it servable:
        ``pending`` when its durable write is under way, ``skipped`` when none will
        follow. On the disk path its policy files go to storage first."""
        saved, write, weights = copy.result()
        if offer_snapshot and weights is not None:
            self.offer(version, weights)
        if disk:
            started = time.monotonic()
            if write is not None:
                write()
            options = self.config.storage.options
            save_checkpoint(saved.policy, url, options, replace=True, link=True)
            self.parts["train/servable_write_s"] = time.monotonic() - started
        self.role.registry.commit(
            version,
            url,
            run_id=self.role.mlflow_run_id,
            tags=tags,
            incarnation=self.role.incarnation,
            durable=False,
            pending=durable,
            check_files=disk,
        )

    def _write_and_commit(
        self,
        copy: Future[Snapshot] | Snapshot,
        write_here: bool,
        version: int,
        tags: dict[str, Any],
        names: list[str],
        cursor: int | None,
        registered_at: str | None,
    ) -> None:
        """The durable half: the local write (unless the disk path's servable job makes
        it), the upload and the commit. With `registered_at` (the version was registered
        servable), its registration is waited for and the commit marks it durable."""
        if self.sender is not None or registered_at is not None:
            failpoint("train.offered_not_durable")  # servable, not yet durable
        saved, write, _ = copy.result() if isinstance(copy, Future) else copy
        started = time.monotonic()
        if write is not None and write_here:
            write()
            self.parts["train/checkpoint_write_s"] = time.monotonic() - started
        registered = self._registered.pop(version, None)
        if registered is not None:
            registered.result()  # the servable thread's disk path wrote the policy too
        self.role.commit_version(
            saved,
            version,
            tags,
            names,
            cursor,
            registered=registered_at is not None,
            policy_saved=self.sender is None and registered_at is not None,
        )
        self._durable_done = version

    def _prune_local(self, newest: Path, writing: Path | None) -> None:
        """Delete the local copies of versions before `newest` but the one a durable job
        may still be `writing` (storage holds links to their files, not the folders)."""
        for old in self.local_root.glob("v*"):
            if old.is_dir() and old.name < newest.name and old != writing:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------ the role's thread

    def check(self) -> None:
        """Raise, on the role's thread, what a finished background job raised."""
        if self._writing is not None and self._writing.done():
            self._writing.result()
        # A registration done is let go (a durable job may pop it first): skipped
        # versions would otherwise keep one future each for the whole run.
        for version, job in list(self._registered.items()):
            if job.done():
                job.result()
                self._registered.pop(version, None)

    def ack_durable(self) -> None:
        """Ack every shard a durable version now covers (after its commit)."""
        durable = self._durable_done
        done = [(v, refs) for v, refs in self._unacked if v <= durable]
        if not done:
            return
        self._unacked = [(v, refs) for v, refs in self._unacked if v > durable]
        self.reader.ack([r for _, refs in done for r in refs], meta={"policy_version": durable})

    def finish(self, trainer: PolicyTrainer | None, trained: int) -> None:
        """Wait for every job, and make the newest version durable if it is not and the
        `trainer` still holds its weights (it trained `trained` steps): a clean stop
        keeps every version it served. `trainer` None: nothing more is saved."""
        self.copying.wait()
        self.servable.wait()
        self.durable.wait()
        self.check()
        self.ack_durable()
        newest = self.newest_published
        if trainer is not None and trained == newest > self.newest_durable_published:
            log.info("making policy version %d durable before stopping", newest)
            self._writing = self.durable.submit(self._make_durable_now, trainer, newest)
            self.durable.wait()
            self.newest_durable_published = newest
            self.ack_durable()
        for old in self.local_root.glob("v*"):
            if old.name != f"v{self._durable_done:06d}":
                shutil.rmtree(old, ignore_errors=True)

    def _make_durable_now(self, trainer: PolicyTrainer, version: int) -> None:
        saved = save_version(trainer, self.local_root / f"v{version:06d}", version)
        names = self._names()
        self.role.commit_version(saved, version, {}, names, None, registered=True)
        self._durable_done = version

    def close(self) -> None:
        try:
            self.copying.close()
            self.servable.close()
        finally:
            self.durable.close()

    def status(self) -> dict[str, Any]:
        """For the train role's status document (`sluice status`): the newest servable
        and durable versions, how many versions a crash now would lose, and the lag."""
        return {
            "newest_servable_version": self.newest_published,
            "newest_durable_version": self._durable_done,
            "versions_at_risk": self.newest_published - self._durable_done,
            "durability_lag_s": self.cadence.lag_s(time.monotonic()),
            "durability_skipped": self.cadence.skipped,
        }

    def report(self) -> dict[str, float]:
        """Background seconds of each thread (outside the role's time states)."""
        return {
            **self.copying.report("background/copy_"),
            **self.servable.report("background/servable_"),
            **self.durable.report("background/durable_"),
        }
