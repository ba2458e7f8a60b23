"""A published policy version's files: what each reader fetches, and where the trainer's
own state lives.

A version is published as two checkpoints and one list (``RunPaths``):

- ``checkpoints/vNNNNNN/``: the policy, a Hugging Face directory (weights, config,
  generation config, tokenizer and chat template files, the manifest). The registry's
  model version points here; rollout and evaluation fetch it, the reward role only its
  tokenizer files.
- ``checkpoints/trainer_state/vNNNNNN/``: the optimizer state (AdamW moments: twice the
  weights), the minibatch RNG and ``trainer_state.json``, with their own manifest. Only a
  resuming trainer reads it, and only the newest committed version's is kept.
- ``checkpoints/consumed/vNNNNNN.json``: the scored shards the version trained on, the
  run's exactly-once record (a few KB; kept for every version).

A LoRA run (``trainer.lora``) publishes every version after 0 as its adapter alone
(``sluice.engines.policy.adapter``: PEFT's files, megabytes) with a reference to its base,
version 0, by URL and digest; version 0 is the base, the model with an empty adapter. A
reader that needs a whole model (evaluation, an export) gets base and adapter merged
(``fetch_policy``); a running server gets the adapter itself (``fetch_update``) and
applies it to the base it was started on. An adapter whose base digest is not the one a
reader holds is refused in one line. Retention never deletes the base of a LoRA run.

All three are durable before the version is committed (``TrainingRole.commit_version``),
so a trainer resuming from the newest committed version always finds its state. A
version published before the trainer state moved out carries it in the policy
directory; such a run still resumes, and its readers skip those files.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.engines.policy.adapter import (
    BASE_REFERENCE_FILE,
    AdapterError,
    is_adapter_dir,
    merge_adapter_dir,
)
from sluice.engines.rl.lineage import LostAfter, lost_after
from sluice.engines.rl.trainer import PolicyTrainer
from sluice.engines.rl.trainer_files import (
    ADAPTER_DIR,
    TRAINER_STATE_FILE,
    is_trainer_state_file,
)
from sluice.infra.checkpoint_cache import fetch_checkpoint
from sluice.infra.checkpoints import (
    MANIFEST_NAME,
    CheckpointIncomplete,
    open_checkpoint_fs,
    read_manifest,
)
from sluice.infra.config.run import RunConfig
from sluice.infra.registry import CheckpointRegistry, CommittedVersion
from sluice.infra.storage import exists, put_atomic, replace_directory, staging_directory
from sluice.tasks.run.paths import RunPaths, read_json

CONSUMED_FILE = "consumed_shards.json"
"""Where versions published before the trainer state moved out kept their consumed list
(in the policy directory)."""
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf")
"""File endings of weights (and of the index naming their shards)."""


def is_policy_file(name: str) -> bool:
    """What an inference engine loads: every file but trainer state (and the consumed
    list that old versions kept beside the weights)."""
    return not is_trainer_state_file(name) and name.rsplit("/", 1)[-1] != CONSUMED_FILE


def is_tokenizer_file(name: str) -> bool:
    """What a tokenizer loads: the policy without its weights (tokenizer, chat template
    and the small config files a tokenizer may consult)."""
    return is_policy_file(name) and not name.endswith(WEIGHT_SUFFIXES)


@dataclass(frozen=True)
class SavedVersion:
    """A version the trainer saved to local disk, before it is uploaded and committed."""

    policy: Path
    """The Hugging Face directory readers will fetch."""
    trainer_state: Path
    """Optimizer, RNG and trainer_state.json: only a resuming trainer reads them."""


def save_version(trainer: PolicyTrainer, local: Path, version: int) -> SavedVersion:
    """Save the trainer's weights and its state as version `version` under `local`."""
    if local.exists():
        shutil.rmtree(local)
    saved = SavedVersion(local / "policy", local / "trainer_state")
    trainer.save(saved.policy, state_dir=saved.trainer_state, extra={"policy_version": version})
    return saved


def save_version_later(
    trainer: PolicyTrainer,
    local: Path,
    version: int,
    *,
    weights_only: bool = False,
    small: tuple[Any, dict[str, Any]] | None = None,
) -> tuple[SavedVersion, Callable[[], None], dict[str, Any]] | None:
    """`save_version` in two halves: the trainer's state copied to host memory now, and
    a function that writes it under `local` later (off the trainer's critical path);
    also the copied weights (a state dict). None when the trainer can only save now
    (`PolicyTrainer.save_later`). `weights_only`: the policy alone (a servable version
    that is not to be durable): no trainer state is copied or written. `small`: the
    RNG state and record taken earlier (`PolicyTrainer.small_state`)."""
    if weights_only:
        write = trainer.save_later(weights_only=True)
    elif small is not None:
        write = trainer.save_later(small=small)
    else:
        write = trainer.save_later()
    if write is None:
        return None
    saved = SavedVersion(local / "policy", local / "trainer_state")

    def finish() -> None:
        if local.exists():
            shutil.rmtree(local)
        if weights_only:
            write(saved.policy)
            return
        write(saved.policy, state_dir=saved.trainer_state, extra={"policy_version": version})

    return saved, finish, write.weights  # type: ignore[attr-defined]


def write_consumed(
    config: RunConfig,
    paths: RunPaths,
    version: int,
    names: list[str],
    next_group: int | None = None,
) -> None:
    """Record the scored shards `version` trained on (one atomic object), and with
    dynamic sampling the first issue number no batch up to `version` took."""
    fs, path = open_checkpoint_fs(paths.consumed(version), config.storage.options)
    record: list[str] | dict[str, Any] = names
    if next_group is not None:
        record = {"shards": names, "next_group": next_group}
    put_atomic(fs, path, json.dumps(record).encode())


def _consumed_record(config: RunConfig, paths: RunPaths, version: CommittedVersion) -> Any:
    record = read_json(config, paths.consumed(version.policy_version))
    if record is None:  # published before the list moved out of the policy directory
        record = read_json(config, f"{version.checkpoint_uri}/{CONSUMED_FILE}")
    return record


def read_consumed(config: RunConfig, paths: RunPaths, version: CommittedVersion) -> list[str]:
    """The scored shards committed `version` trained on ([] for version 0 or when none
    were recorded)."""
    record = _consumed_record(config, paths, version)
    return list((record.get("shards") if isinstance(record, dict) else record) or [])


def read_next_group(config: RunConfig, paths: RunPaths, version: CommittedVersion) -> int | None:
    """The first issue number no batch up to `version` took, as a dynamic-sampling run
    recorded it (None: not recorded; every batch was B numbers)."""
    if version.policy_version == 0:
        return 0
    record = _consumed_record(config, paths, version)
    return int(record["next_group"]) if isinstance(record, dict) else None


def fetch_update(
    config: RunConfig, version: CommittedVersion, cache_dir: Path, keep_latest: int | None = None
) -> Path:
    """What a running server loads to serve `version`: its policy files on local disk
    (the storage path itself for a local URL), the adapter alone for an adapter version."""
    return fetch_checkpoint(
        version.checkpoint_uri,
        cache_dir,
        storage_options=config.storage.options,
        keep_latest=keep_latest,
        select=is_policy_file,
    )


def fetch_policy(
    config: RunConfig, version: CommittedVersion, cache_dir: Path, keep_latest: int | None = None
) -> Path:
    """`version` as a whole model on local disk: its own directory, or for an adapter
    version its base and adapter merged (`keep_latest` merged copies are kept)."""
    return fetch_model_uri(config, version.checkpoint_uri, cache_dir, keep_latest)


def fetch_model_uri(
    config: RunConfig, uri: str, cache_dir: Path, keep_latest: int | None = None
) -> Path:
    """`fetch_policy` for a checkpoint URI (a version the registry may not know)."""
    local = fetch_checkpoint(
        uri,
        cache_dir,
        storage_options=config.storage.options,
        keep_latest=keep_latest,
        select=is_policy_file,
    )
    if not is_adapter_dir(local):
        return local
    base = fetch_base(config, local, cache_dir / "base")
    digest = read_manifest(uri, config.storage.options).digest
    merged_root = cache_dir / "merged"
    merged = merged_root / digest[:24]
    if not (merged / "model.safetensors").is_file():
        with staging_directory(merged) as staging:
            merge_adapter_dir(base, local, staging)
            replace_directory(staging, merged)
    now_ns = time.time_ns()
    os.utime(merged, ns=(now_ns, now_ns))
    if keep_latest is not None:
        copies = [p for p in merged_root.iterdir() if not p.name.startswith(".")]
        copies.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in copies[keep_latest:]:
            shutil.rmtree(old, ignore_errors=True)
    return merged


def read_base_reference(adapter_dir: Path) -> dict[str, Any]:
    """The base an adapter version was trained on: ``base_uri``, ``base_digest``,
    ``base_version`` (AdapterError when the adapter names none)."""
    path = adapter_dir / BASE_REFERENCE_FILE
    try:
        reference = json.loads(path.read_text())
        str(reference["base_uri"]), str(reference["base_digest"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AdapterError(f"adapter {str(adapter_dir)!r} names no base ({path}: {exc})") from exc
    return dict(reference)


def check_base(
    reference: dict[str, Any], base_digest: str, adapter: str, holder: str
) -> dict[str, Any]:
    """Refuse, in one line, an `adapter` whose `reference` names another base than
    `base_digest`, the digest of `holder` ("the base the servers were started on")."""
    if reference.get("base_digest") != base_digest:
        raise AdapterError(
            f"{adapter} was trained on base {str(reference.get('base_digest'))[:12]} "
            f"({reference.get('base_uri')}), not on {holder} ({base_digest[:12]}); an "
            "adapter applies only to the base it was trained on"
        )
    return reference


def fetch_base(config: RunConfig, adapter_dir: Path, cache_dir: Path) -> Path:
    """The base model `adapter_dir` names, on local disk (one copy kept), checked
    against the digest the adapter records."""
    reference = read_base_reference(adapter_dir)
    manifest = read_manifest(reference["base_uri"], config.storage.options)
    check_base(reference, manifest.digest, f"adapter {str(adapter_dir)!r}", "what that URL holds")
    return fetch_checkpoint(
        reference["base_uri"],
        cache_dir,
        storage_options=config.storage.options,
        keep_latest=1,
        select=is_policy_file,
    )


def base_reference(config: RunConfig, registry: CheckpointRegistry) -> dict[str, Any]:
    """The reference an adapter version records: version 0, the run's base."""
    base = registry.get(0)
    if base is None or base.deleted:
        raise CheckpointIncomplete(
            "a LoRA run's versions are adapters on version 0, and version 0 is gone"
        )
    digest = read_manifest(base.checkpoint_uri, config.storage.options).digest
    return {"base_version": 0, "base_uri": base.checkpoint_uri, "base_digest": digest}


def write_base_reference(policy_dir: Path, reference: dict[str, Any]) -> None:
    (policy_dir / BASE_REFERENCE_FILE).write_text(json.dumps(reference, indent=2))


def serving_start(config: RunConfig, registry: CheckpointRegistry) -> CommittedVersion | None:
    """The version a cold server starts on, from storage: the newest durable one, or for a
    LoRA run its base (version 0), which every later version's adapter is applied to.
    The rollout then moves it to the newest servable version as it would any update."""
    if config.trainer.lora.rank:
        return registry.get(0)
    return registry.newest_durable()


def fetch_tokenizer(config: RunConfig, version: CommittedVersion, cache_dir: Path) -> Path:
    """A directory holding `version`'s tokenizer files; no weight file is read."""
    return fetch_checkpoint(
        version.checkpoint_uri,
        cache_dir,
        storage_options=config.storage.options,
        select=is_tokenizer_file,
    )


def fetch_training_dir(
    config: RunConfig, paths: RunPaths, version: CommittedVersion, local_root: Path
) -> Path:
    """A directory a trainer resumes `version` from: its policy files and trainer state.

    Raises CheckpointIncomplete naming the trainer state's URL when a version after 0
    has none (deleted or damaged outside Sluice): resuming with a fresh optimizer would
    silently leave the run it continues.
    """
    options = config.storage.options
    state_url = paths.trainer_state(version.policy_version)
    fs, state_path = open_checkpoint_fs(state_url, options)
    # One copy per cache: a restart needs the newest version only.
    if exists(fs, f"{state_path}/{MANIFEST_NAME}"):
        policy = fetch_update(config, version, local_root / "init", keep_latest=1)
        state = fetch_checkpoint(state_url, local_root / "init-state", options, keep_latest=1)
        if not is_adapter_dir(policy):
            return _side_by_side([(policy, "."), (state, ".")], local_root / "resume")
        # A LoRA trainer: the base, its state, and the adapter apart (trainer_files.ADAPTER_DIR).
        base = fetch_base(config, policy, local_root / "base")
        parts = [(base, "."), (state, "."), (policy, ADAPTER_DIR)]
        return _side_by_side(parts, local_root / "resume")
    names = {entry.name for entry in read_manifest(version.checkpoint_uri, options).files}
    if TRAINER_STATE_FILE in names or version.policy_version == 0:
        # Version 0 starts a fresh optimizer; an old version carries its state inside.
        return fetch_checkpoint(version.checkpoint_uri, local_root / "init", options, keep_latest=1)
    raise CheckpointIncomplete(
        f"the trainer state of policy version {version.policy_version} is missing: no "
        f"{MANIFEST_NAME} at {state_url!r}"
    )


def _side_by_side(sources: list[tuple[Path, str]], into: Path) -> Path:
    """`into` made a directory of links to every file of each source directory, under
    the subfolder named beside it ("." for `into` itself)."""
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    for source, under in sources:
        for path in source.rglob("*"):
            if path.is_file() and path.name != MANIFEST_NAME:
                link = into / under / path.relative_to(source)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(path.resolve())
    return into


def superseded(registry: CheckpointRegistry, version: CommittedVersion) -> bool:
    """Whether `version` was deleted by retention or lost, or a newer one is servable: a
    reader that could not fetch it should move on to the newest instead of failing."""
    now = registry.get(version.policy_version, incarnation=version.incarnation)
    latest = registry.newest_servable()
    return (now is not None and (now.deleted or now.lost)) or (
        latest is not None and latest.identity > version.identity
    )


def fetch_reference(
    config: RunConfig, registry: CheckpointRegistry, cache_dir: Path
) -> Path | None:
    """Version 0's policy on local disk: the reference policy of a KL penalty when the
    trainer fine-tunes every weight (None when there is no penalty, or a LoRA trainer
    has its base in memory already)."""
    if config.trainer.kl.coef == 0 or config.trainer.lora.rank:
        return None
    base = registry.get(0)
    if base is None or base.deleted:
        raise CheckpointIncomplete(
            "trainer.kl's reference policy is version 0, and version 0 is gone"
        )
    return fetch_checkpoint(
        base.checkpoint_uri,
        cache_dir,
        storage_options=config.storage.options,
        keep_latest=1,
        select=is_policy_file,
    )


def lost_versions(versions: Iterable[CommittedVersion]) -> LostAfter:
    """The registry's lost versions as `LostAfter` (empty when no trainer ever restarted
    from behind a served version)."""
    return lost_after((v.incarnation, v.policy_version) for v in versions if v.lost)
