"""The books of a finished run, read back from storage and the registry: what a fault
could have broken, counted, over the *surviving lineage* (docs/design.md §2: versions
served and then lost to a crash are not part of it; the steps they held were trained
again).

- the surviving lineage has one version per step 0 .. total_steps; every durable
  version's checkpoint is complete (its manifest verifies) unless retention deleted it
  (tagged `sluice.deleted`), the newest durable version's trainer state is complete, the
  servable alias names the newest version and the durable alias the newest durable one;
- no shard was acked twice by one consumer (`reward` over rollouts, `trainer` over
  scored), no scored shard went into two durable versions, and the trainer's ledger
  acks exactly the shards the durable versions list plus those it dropped for holding
  tokens of lost versions;
- every shard holds whole groups (`group_size` rows each); a group dropped for holding
  lost tokens went again as a new attempt, in a shard of its own;
- the durable versions together trained exactly the groups issued as numbers
  0 .. total_steps x B - 1 (durable version k lists those of the steps since the durable
  version before it): none lost, none extra, and none holding a token of a lost version;
- every row of one group number carries the same prompt (re-issued with its prompt);
- no trained sample was generated more than eta versions before the step that trained
  it (group n is trained by step floor(n / B) + 1).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from sluice.engines.rl.groups import group_index_of
from sluice.engines.rl.lineage import lost_groups
from sluice.infra.checkpoints import CheckpointError, verify_checkpoint
from sluice.infra.config.run import RunConfig
from sluice.infra.streams.reader import StreamReader
from sluice.tasks.run.paths import ROLLOUTS, SCORED, run_paths, run_registry
from sluice.tasks.run.versions import lost_versions, read_consumed


@dataclass
class RunAudit:
    run_id: str
    total_steps: int
    max_staleness_allowed: int
    versions: list[int] = field(default_factory=list)
    """Steps of the surviving lineage's versions, in order."""
    alias_version: int | None = None
    durable_versions: list[int] = field(default_factory=list)
    durable_alias_version: int | None = None
    lost_versions: list[str] = field(default_factory=list)
    """Versions served and then lost to a crash (``r/vk``)."""
    groups_lineage_dropped: int = 0
    """Scored shards the trainer dropped for holding tokens of lost versions."""
    trained_lost_tokens: list[int] = field(default_factory=list)
    """Group numbers a durable version trained that hold tokens of lost versions."""
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
        newest_durable = self.durable_versions[-1] if self.durable_versions else None
        if self.durable_alias_version != newest_durable:
            found.append(f"durable alias on {self.durable_alias_version}, newest {newest_durable}")
        if self.trained_lost_tokens:
            found.append(f"groups with tokens of lost versions trained: {self.trained_lost_tokens}")
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
    everything = registry.versions()
    lost = lost_versions(everything)
    audit.lost_versions = [v.name for v in everything if v.lost]
    surviving = [v for v in everything if not v.lost]
    audit.versions = [v.policy_version for v in surviving]
    committed = [v for v in surviving if v.durable]
    audit.durable_versions = [v.policy_version for v in committed]
    latest, durable = registry.newest_servable(), registry.newest_durable()
    audit.alias_version = latest.policy_version if latest else None
    audit.durable_alias_version = durable.policy_version if durable else None
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
    not_whole: dict[str, set[int]] = {ROLLOUTS: set(), SCORED: set()}
    group_size = config.rollout.group_size

    def whole(stream: str, ids: list[str]) -> None:
        """Each shard holds whole groups (an attempt of a group is a shard of its own)."""
        counts = Counter(map(group_index_of, ids))
        not_whole[stream].update(g for g, n in counts.items() if n != group_size)

    rollout_refs = rollouts.committed()
    for ref in rollout_refs:
        table = rollouts.read(ref).select(["group_id", "prompt_id"])
        ids = table.column("group_id").to_pylist()
        for group_id, prompt_id in zip(ids, table.column("prompt_id").to_pylist(), strict=True):
            prompts[group_index_of(group_id)].add(prompt_id)
        whole(ROLLOUTS, ids)
    audit.prompts_changed = sorted(g for g, seen in prompts.items() if len(seen) > 1)

    scored = reader(SCORED, "audit")
    by_name = {ref.name: ref for ref in scored.committed()}
    for ref in by_name.values():
        whole(SCORED, scored.read(ref).column("group_id").to_pylist())
    audit.groups_not_whole = {stream: sorted(g) for stream, g in not_whole.items()}
    audit.shards = {ROLLOUTS: len(rollout_refs), SCORED: len(by_name)}
    B = config.trainer.prompts_per_batch
    listed: Counter[str] = Counter()
    trained: set[int] = set()
    previous = 0
    for version in committed[1:]:
        names = read_consumed(config, paths, version)
        listed.update(names)
        for name in names:
            if name not in by_name:
                continue
            table = scored.read(by_name[name])
            groups = list(map(group_index_of, table.column("group_id").to_pylist()))
            starts = table.column("version_start").to_pylist()
            for group, start in zip(groups, starts, strict=True):
                audit.max_staleness = max(audit.max_staleness, group // B - start)
            trained.update(groups)
            audit.trained_lost_tokens += sorted(lost_groups(table, lost))
        expected = set(range(previous * B, version.policy_version * B))
        audit.groups_lost += sorted(expected - trained)
        previous = version.policy_version
    audit.groups_extra = sorted(trained - set(range(previous * B)))
    audit.trained_twice = sum(n - 1 for n in listed.values() if n > 1)
    trainer = reader(SCORED, "trainer")
    dropped = {
        shard
        for record in trainer.records()
        if record.meta.get("lineage_dropped")
        for shard in record.shards
    }
    audit.groups_lineage_dropped = len(dropped)
    audit.ledger_mismatch = sorted((set(listed) | dropped) ^ trainer.acked())
    return audit
