"""Servable before durable (tasks/train/publisher.py): every published version is registered
as soon as the servers can get it, every N-th one also becomes durable, shards are acked
only once a durable version covers them, and a slow store makes versions skip
durability instead of holding training up. Real trainer, sqlite MLflow, files, streams.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sluice.infra.checkpoints import CheckpointIncomplete, read_manifest, verify_checkpoint
from sluice.infra.config.run import RunConfig
from sluice.infra.failpoints import ENV
from sluice.infra.streams.reader import StreamReader
from sluice.tasks.run.versions import read_consumed
from sluice.tasks.train.publisher import Publisher

from .test_publish_layout import batch, local_path, make_trainer, scored_shard, start_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def config(local_run_config: Callable[..., RunConfig], tmp_path: Path) -> RunConfig:
    return local_run_config(
        tmp_path,
        "checkpoint.every_versions=3",
        "evaluation.every=0",
        "trainer.total_steps=50",
        "storage.keep_versions=0",
    )


def acked(config: RunConfig, shard) -> bool:
    return StreamReader(config.storage.url, "run", "scored", consumer="trainer").is_acked(
        shard.name
    )


def train_and_publish(role, trainer, versions, config):
    """Publish `versions`, each once the one before is on storage (so none skips)."""
    shards = {}
    for version in versions:
        trainer.train_step(batch(trainer.model.config.vocab_size))
        shards[version] = scored_shard(config, version)
        role.publish(trainer, version, [shards[version]], {"reward_mean": "0.5"})
        role.publisher.servable.wait()
        role.publisher.durable.wait()
    return shards


def test_every_version_is_servable_and_every_third_durable_with_acks_after_it(config, tiny_dir):
    role = start_run(config, tiny_dir)
    trainer = make_trainer(tiny_dir)
    shards = train_and_publish(role, trainer, [1, 2, 3, 4], config)
    role.publisher.servable.wait()
    role.publisher.durable.wait()

    states = {v.policy_version: v.durability for v in role.registry.versions()}
    assert states == {0: "true", 1: "skipped", 2: "skipped", 3: "true", 4: "skipped"}
    assert role.registry.newest_servable().policy_version == 4
    assert role.registry.newest_durable().policy_version == 3
    # The disk path: a pending version's policy is on storage, its trainer state is not.
    pending = role.registry.get(4)
    assert verify_checkpoint(pending.checkpoint_uri)
    with pytest.raises(CheckpointIncomplete):
        read_manifest(role.paths.trainer_state(4))
    assert read_manifest(role.paths.trainer_state(3)).files
    # Durable v3's consumed list names everything trained since v0: v1..v3's shards.
    assert read_consumed(config, role.paths, role.registry.get(3)) == [
        shards[v].name for v in (1, 2, 3)
    ]
    role.publisher.ack_durable()
    assert [acked(config, shards[v]) for v in (1, 2, 3, 4)] == [True, True, True, False]

    # A clean stop makes the newest version durable and acks what it trained.
    role.finish_publish(trainer, 4)
    assert role.registry.newest_durable().policy_version == 4
    assert role.registry.get(4).checkpoint_digest == read_manifest(pending.checkpoint_uri).digest
    assert read_consumed(config, role.paths, role.registry.get(4)) == [shards[4].name]
    assert acked(config, shards[4])
    role.publisher.close()
    role.publisher.stop_sender()


def test_a_stop_after_unpublished_steps_keeps_the_newest_published_version_pending(
    config, tiny_dir
):
    role = start_run(config, tiny_dir)
    trainer = make_trainer(tiny_dir)
    shards = train_and_publish(role, trainer, [1], config)
    trainer.train_step(batch(trainer.model.config.vocab_size))  # a step never published
    role.finish_publish(trainer, 2)  # its weights are not version 1's any more
    assert role.registry.get(1).durability == "skipped"
    assert not acked(config, shards[1])  # a resume trains it again from version 0
    role.publisher.close()
    role.publisher.stop_sender()


def test_a_slow_store_makes_due_versions_skip_durability_instead_of_waiting(
    config, tiny_dir, tmp_path, monkeypatch
):
    # The shared-memory path: the servers get versions from the sender, so only the
    # durable writes touch the (slow) store.
    config = config.model_copy(deep=True)
    config.servers.weight_transfer = "shared_memory"
    plan = tmp_path / "failpoints.json"
    plan.write_text(json.dumps({"checkpoint.put_file": {"sleep_s": 1.0}}))
    monkeypatch.setenv(ENV, str(plan))
    role = start_run(config, tiny_dir)
    role.publisher = Publisher(role, role.reader, role.local_root, 0)
    role.publisher.start_sender()
    trainer = make_trainer(tiny_dir)
    stalls = {}
    for version in range(1, 7):
        trainer.train_step(batch(trainer.model.config.vocab_size))
        started = time.monotonic()
        role.publish(trainer, version, [scored_shard(config, version)], {})
        stalls[version] = time.monotonic() - started
    role.publisher.servable.wait()
    role.publisher.durable.wait()

    states = {v.policy_version: v.durability for v in role.registry.versions()}
    # v3 became durable; v6 was due while v3's slow write still ran, so it skipped; the
    # others were never due.
    assert states[3] == "true" and all(states[v] == "skipped" for v in (1, 2, 4, 5, 6)), states
    assert role.publisher.cadence.skipped == 1
    # No publish waited for the store (each slow file sleeps 1 s).
    assert max(stalls.values()) < 1.0, stalls
    assert role.publisher.sender.get(6) is not None  # the servers can have the newest
    fired = json.loads(plan.read_text())["fired"]
    assert any(f["name"] == "checkpoint.put_file" for f in fired)
    role.publisher.close()
    role.publisher.stop_sender()


def test_retention_lets_servable_only_versions_go_and_keeps_two_trainer_states(
    local_run_config, tmp_path, tiny_dir
):
    config = local_run_config(
        tmp_path,
        "checkpoint.every_versions=3",
        "evaluation.every=0",
        "trainer.total_steps=50",
        "storage.keep_versions=2",
    )
    role = start_run(config, tiny_dir)
    trainer = make_trainer(tiny_dir)
    train_and_publish(role, trainer, range(1, 8), config)
    role.finish_publish(trainer, 7)  # v7 made durable at the stop: retention runs after it

    versions = {v.policy_version: v for v in role.registry.versions()}
    durable = sorted(k for k, v in versions.items() if v.durable)
    assert durable == [0, 3, 6, 7]
    # Kept: v0 (still to be scored), the newest two durable and the newest two versions.
    deleted = sorted(k for k, v in versions.items() if v.deleted)
    assert deleted == [1, 2, 3, 4, 5]
    on_disk = {p.name for p in local_path(role.paths.checkpoints).iterdir()}
    assert {"v000000", "v000006", "v000007"} <= on_disk
    assert not on_disk & {f"v{k:06d}" for k in deleted}
    states = {p.name for p in local_path(role.paths.trainer_states).iterdir()}
    assert states == {"v000006", "v000007"}
    role.publisher.close()


def test_the_snapshot_copies_the_published_weights_while_the_next_step_trains(config, tiny_dir):
    """The copy runs beside the next step's forward and backward; the optimizer step
    waits for it, so the durable checkpoint holds exactly the published weights."""
    from safetensors.torch import load_file

    role = start_run(config, tiny_dir)
    trainer = make_trainer(tiny_dir)
    train_and_publish(role, trainer, [1, 2], config)
    trainer.train_step(batch(trainer.model.config.vocab_size))
    published = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    role.publish(trainer, 3, [scored_shard(config, 3)], {})  # due: snapshot, then durable
    assert trainer.update_fence is not None  # the copy may still be running
    metrics = trainer.train_step(batch(trainer.model.config.vocab_size))  # no wait first
    assert trainer.update_fence is None and metrics["train/update_fence_wait_s"] >= 0.0
    role.finish_publish()

    assert role.registry.get(3).durable
    saved = load_file(str(local_path(role.registry.get(3).checkpoint_uri) / "model.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(tensor, published[name]), name
    moved = trainer.model.state_dict()
    assert any(not torch.equal(moved[n], published[n]) for n in saved)  # training went on
    role.publisher.close()


def test_a_trainer_resumed_from_a_snapshot_taken_beside_the_next_step_trains_on_exactly(
    config, tiny_dir, tmp_path
):
    """The snapshot's tensors wait behind the update fence, and its RNG state and step
    count are taken when the version is published: the next step, which draws its
    minibatches from that RNG while the copy runs, does not leak into the checkpoint."""
    uninterrupted = make_trainer(tiny_dir)
    samples = batch(uninterrupted.model.config.vocab_size)
    expected = [uninterrupted.train_step(samples)["loss/policy_loss"] for _ in range(5)]

    role = start_run(config, tiny_dir)
    trainer = make_trainer(tiny_dir)
    losses = []
    for version in (1, 2, 3):
        losses.append(trainer.train_step(samples)["loss/policy_loss"])
        role.publish(trainer, version, [scored_shard(config, version)], {})  # v3: durable
    losses.append(trainer.train_step(samples)["loss/policy_loss"])  # beside v3's copy
    role.publisher.servable.wait()
    role.publisher.durable.wait()
    assert role.registry.newest_durable().policy_version == 3

    resumed = make_trainer(role.training_dir(role.registry.newest_durable(), tmp_path / "r"))
    assert resumed.steps_done == 3
    again = [resumed.train_step(samples)["loss/policy_loss"] for _ in range(2)]
    assert losses == expected[:4] and again == expected[3:]
    role.publisher.close()
