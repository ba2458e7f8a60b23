"""The books of a finished run, read back from storage and the registry: what a fault
could have broken, counted.

- every committed version's checkpoint is complete (its manifest verifies) unless
  retention deleted it (tagged `sluice.deleted`), the newest version's trainer state is
  complete, the alias names the newest version, and the run reached its step count;
- no shard was acked twice by one consumer (`reward` over rollouts, `trainer` over
  scored), no scored shard went into two versions, and the shards the versions list
  are exactly the ones the trainer's ledger acks;
- every group number reached each stream whole, once: `group_size` rows (a role
  restarted after a crash re-does its work under the same shard key, never beside it);
- version v trained exactly the groups issued as numbers (v-1)B .. vB-1: none lost,
  none extra (a re-issued group keeps its number);
- every row of one group number carries the same prompt (re-issued with its prompt);
- no trained sample was generated more than eta versions before it was trained.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from sluice.engines.rl.groups import group_index_of
from sluice.infra.checkpoints import CheckpointError, verify_checkpoint
from sluice.infra.config import RunConfig
from sluice.infra.streams.reader import StreamReader
from sluice.tasks.run.paths import ROLLOUTS, SCORED, run_paths, run_registry
from sluice.tasks.run.versions import read_consumed


@dataclass
class RunAudit:
    run_id: str
    total_steps: int
    max_staleness_allowed: int
    versions: list[int] = field(default_factory=list)
    alias_version: int | None = None
    incomplete_versions: list[int] = field(default_factory=list)
    shards: dict[str, int] = field(default_factory=dict)
    """Committed shards per stream."""
    acked_twice: dict[str, int] = field(default_factory=dict)
    """Per consumer: shards its ledger acks more than once."""
    trained_twice: int = 0
    """Scored shards listed by more than one version."""
    groups_lost: list[int] = field(default_factory=list)
    groups_extra: list[int] = field(default_factory=list)
    prompts_changed: list[int] = field(default_factory=list)
    """Group numbers whose rows name more than one prompt."""
    groups_not_whole: dict[str, list[int]] = field(default_factory=dict)
    """Per stream: group numbers whose row count is not the group size."""
    ledger_mismatch: list[str] = field(default_factory=list)
    """Scored shards listed by a version but not acked by the trainer, or the reverse."""
    max_staleness: int = 0
    """Largest (trained version - 1) - (version a sample's generation started at)."""

    @property
    def duplicated(self) -> int:
        return sum(self.acked_twice.values()) + self.trained_twice

    def problems(self) -> list[str]:
        found = []
        if not self.versions or self.versions[-1] != self.total_steps:
            found.append(f"reached version {self.versions[-1:]} of {self.total_steps}")
        if self.versions != list(range(len(self.versions))):
            found.append(f"versions not contiguous: {self.versions}")
        if self.alias_version != (self.versions[-1] if self.versions else None):
            found.append(f"alias on {self.alias_version}, newest is {self.versions[-1:]}")
        if self.incomplete_versions:
            found.append(f"incomplete checkpoints: versions {self.incomplete_versions}")
        if self.duplicated:
            found.append(f"duplicated: {self.acked_twice}, trained twice {self.trained_twice}")
        if self.groups_lost or self.groups_extra:
            found.append(f"groups lost {self.groups_lost}, extra {self.groups_extra}")
        if self.prompts_changed:
            found.append(f"groups re-issued with another prompt: {self.prompts_changed}")
        if any(self.groups_not_whole.values()):
            found.append(f"groups not of the group size: {self.groups_not_whole}")
        if self.ledger_mismatch:
            found.append(f"trained shards and the trainer's acks differ: {self.ledger_mismatch}")
        if self.max_staleness > self.max_staleness_allowed:
            found.append(f"staleness {self.max_staleness} > eta {self.max_staleness_allowed}")
        return found


def _acked_twice(reader: StreamReader) -> int:
    records = {record.record_id: record for record in reader.records()}
    counts = Counter(shard for record in records.values() for shard in record.shards)
    return sum(n - 1 for n in counts.values() if n > 1)


def audit_run(config: RunConfig, run_id: str) -> RunAudit:
    """Read the run's registry, checkpoints, streams and ledgers; count what is wrong."""
    url, options = config.storage.url, config.storage.options
    audit = RunAudit(run_id, config.trainer.total_steps, config.staleness.max_staleness)
    registry = run_registry(config, run_id)
    committed = registry.versions()
    audit.versions = [v.policy_version for v in committed]
    latest = registry.newest_servable()
    audit.alias_version = latest.policy_version if latest else None
    paths = run_paths(config, run_id)
    for version in committed:
        if version.deleted:
            continue
        try:
            verify_checkpoint(version.checkpoint_uri, options, check_hashes=True)
            if version is committed[-1] and version.policy_version > 0:
                state = paths.trainer_state(version.policy_version)
                verify_checkpoint(state, options, check_hashes=True)
        except (CheckpointError, OSError):
            audit.incomplete_versions.append(version.policy_version)

    def reader(stream: str, consumer: str) -> StreamReader:
        return StreamReader(url, run_id, stream, consumer=consumer, storage_options=options)

    audit.acked_twice = {
        "reward": _acked_twice(reader(ROLLOUTS, "reward")),
        "trainer": _acked_twice(reader(SCORED, "trainer")),
    }
    rollouts = reader(ROLLOUTS, "audit")
    prompts: dict[int, set[str]] = defaultdict(set)
    rows: dict[str, Counter[int]] = {ROLLOUTS: Counter(), SCORED: Counter()}
    rollout_refs = rollouts.committed()
    for ref in rollout_refs:
        table = rollouts.read(ref).select(["group_id", "prompt_id"])
        for group_id, prompt_id in zip(*(c.to_pylist() for c in table.columns), strict=True):
            prompts[group_index_of(group_id)].add(prompt_id)
            rows[ROLLOUTS][group_index_of(group_id)] += 1
    audit.prompts_changed = sorted(g for g, seen in prompts.items() if len(seen) > 1)

    scored = reader(SCORED, "audit")
    by_name = {ref.name: ref for ref in scored.committed()}
    for ref in by_name.values():
        rows[SCORED].update(map(group_index_of, scored.read(ref).column("group_id").to_pylist()))
    group_size = config.rollout.group_size
    audit.groups_not_whole = {
        stream: sorted(g for g, n in counts.items() if n != group_size)
        for stream, counts in rows.items()
    }
    audit.shards = {ROLLOUTS: len(rollout_refs), SCORED: len(by_name)}
    B = config.trainer.prompts_per_batch
    listed: Counter[str] = Counter()
    for version in committed[1:]:
        names = read_consumed(config, paths, version)
        listed.update(names)
        trained: set[int] = set()
        for name in names:
            if name not in by_name:
                continue
            table = scored.read(by_name[name]).select(["group_id", "version_start"])
            starts = table.column("version_start").to_pylist()
            audit.max_staleness = max(audit.max_staleness, version.policy_version - 1 - min(starts))
            trained.update(group_index_of(g) for g in table.column("group_id").to_pylist())
        expected = set(range((version.policy_version - 1) * B, version.policy_version * B))
        audit.groups_lost += sorted(expected - trained)
        audit.groups_extra += sorted(trained - expected)
    audit.trained_twice = sum(n - 1 for n in listed.values() if n > 1)
    acked = reader(SCORED, "trainer").acked()
    audit.ledger_mismatch = sorted(set(listed) ^ acked)
    return audit
