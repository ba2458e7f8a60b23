"""What a published version is made of, and who reads which part (tasks/run/versions.py).

A version's checkpoint holds the policy only (weights, config, tokenizer); the trainer
state (optimizer, RNG, trainer_state.json) lives apart under `trainer_state/`, and the
consumed shard list under `consumed/`. A trainer resumed from the newest version
restores its optimizer exactly; the reward role reads the tokenizer and never a weight
file; a version published in the old layout (trainer state inside) still resumes, and
its readers leave the trainer state behind. Real sqlite MLflow, real files, real trainer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice.engines.rl.groups import group_key
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.train_batch import TrainerSettings, TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer
from sluice.engines.rl.trainer_files import is_trainer_state_file
from sluice.infra.checkpoints import CheckpointIncomplete, read_manifest, save_checkpoint
from sluice.infra.config.run import RunConfig
from sluice.infra.storage import open_filesystem
from sluice.infra.streams.reader import StreamReader
from sluice.infra.streams.schema import table_from_rows
from sluice.infra.streams.writer import StreamWriter
from sluice.tasks.prompts import load_policy_tokenizer
from sluice.tasks.run.versions import fetch_policy, read_consumed

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def config(local_run_config: Callable[..., RunConfig], tmp_path: Path) -> RunConfig:
    return local_run_config(tmp_path)


def make_trainer(model_dir: Path) -> PolicyTrainer:
    # Two minibatches: the second optimizer step sees a seeded permutation of the batch.
    settings = TrainerSettings(lr=1e-3, ppo_minibatches=2, seed=7)
    return PolicyTrainer(model_dir, settings, make_policy_loss(), None)


def batch(vocab: int, n: int = 6) -> list[TrainingSample]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        response = rng.integers(4, vocab, size=int(rng.integers(2, 10)))
        logprobs = rng.normal(-3.0, 0.1, size=len(response))
        out.append(TrainingSample(rng.integers(4, vocab, size=4), response, logprobs, i % 2 - 0.5))
    return out


def scored_shard(config: RunConfig, index: int) -> object:
    rows = [
        {
            "sample_id": f"{group_key(index)}-000",
            "group_id": group_key(index),
            "prompt_id": f"p{index}",
            "prompt_token_ids": [1, 2],
            "response_token_ids": [3],
            "behaviour_logprobs": [-0.5],
            "token_versions": [0],
            "finish_reason": "stop",
            "reward": 1.0,
            "task": "t",
            "worker": "w",
        }
    ]
    writer = StreamWriter(config.storage.url, "run", "scored", writer_id="reward")
    return writer.write(table_from_rows(rows), shard_key=group_key(index))


def start_run(config: RunConfig, tiny_dir: Path):
    from sluice.tasks.train.role import TrainRole

    role = TrainRole(config, "run", mlflow_run_id="")
    role.registry.commit(0, save_checkpoint(tiny_dir, role.paths.checkpoint(0)))
    return role


def local_path(url: str) -> Path:
    return Path(url.removeprefix("file://"))


def test_a_published_version_holds_the_policy_only_and_its_trainer_state_lives_apart(
    config, tiny_dir
):
    role = start_run(config, tiny_dir)
    trainer = make_trainer(tiny_dir)
    trainer.train_step(batch(trainer.model.config.vocab_size))
    shard = scored_shard(config, 0)

    role.publish(trainer, 1, [shard], {"reward_mean": "0.5"})
    role.finish_publish()

    committed = role.registry.newest_servable()
    assert committed.policy_version == 1
    policy = {entry.name for entry in read_manifest(committed.checkpoint_uri).files}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= policy
    assert not [name for name in policy if is_trainer_state_file(name) or "consumed" in name]
    on_disk = {p.name for p in local_path(committed.checkpoint_uri).iterdir()}
    assert on_disk == policy | {"sluice_manifest.json"}  # nothing beside the manifest's files

    state_url = role.paths.trainer_state(1)
    state = {entry.name for entry in read_manifest(state_url).files}
    assert state == {"optimizer.pt", "trainer_rng.pt", "trainer_state.json"}
    saved = json.loads((local_path(state_url) / "trainer_state.json").read_text())
    assert saved["policy_version"] == 1 and saved["steps_done"] == 1

    assert read_consumed(config, role.paths, committed) == [shard.name]
    assert StreamReader(config.storage.url, "run", "scored", consumer="trainer").is_acked(
        shard.name
    )


def test_a_trainer_resumed_from_the_newest_version_restores_its_optimizer_exactly(
    config, tiny_dir, tmp_path
):
    uninterrupted = make_trainer(tiny_dir)
    samples = batch(uninterrupted.model.config.vocab_size)
    expected = [uninterrupted.train_step(samples)["loss/policy_loss"] for _ in range(3)]

    role = start_run(config, tiny_dir)
    first = make_trainer(tiny_dir)
    losses = [first.train_step(samples)["loss/policy_loss"]]
    role.publish(first, 1, [], {})
    role.finish_publish()

    resumed = make_trainer(role.training_dir(role.registry.newest_servable(), tmp_path / "resume"))
    saved_state, restored = first.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert saved_state["state"].keys() == restored["state"].keys() != set()
    for key, moments in saved_state["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[name], restored["state"][key][name]), (key, name)
    assert resumed.steps_done == 1
    losses += [resumed.train_step(samples)["loss/policy_loss"] for _ in range(2)]
    assert losses == expected  # exact: moments, step count and minibatch RNG all came back


def test_a_version_without_its_trainer_state_stops_the_resume_naming_it(config, tiny_dir):
    import shutil

    role = start_run(config, tiny_dir)
    trainer = make_trainer(tiny_dir)
    role.publish(trainer, 1, [], {})
    role.finish_publish()
    shutil.rmtree(local_path(role.paths.trainer_state(1)))

    with pytest.raises(CheckpointIncomplete, match="trainer state of policy version 1 is missing"):
        role.training_dir(role.registry.newest_servable(), role.local_root)


def test_an_old_layout_version_still_resumes_and_its_readers_skip_the_trainer_state(
    local_run_config, tmp_path, tiny_dir
):
    """Published before the trainer state moved out: optimizer inside the policy folder."""
    config = local_run_config(tmp_path, f"storage.url=memory://old-layout-{tmp_path.name}")
    role = start_run(config, tiny_dir)
    trainer = make_trainer(tiny_dir)
    trainer.train_step(batch(trainer.model.config.vocab_size))
    old = tmp_path / "old-v1"
    trainer.save(old, extra={"policy_version": 1})  # no state_dir: everything in one folder
    (old / "consumed_shards.json").write_text(json.dumps(["shard-a"]))
    role.registry.commit(1, save_checkpoint(old, role.paths.checkpoint(1)))
    committed = role.registry.newest_servable()

    resumed = make_trainer(role.training_dir(committed, tmp_path / "train"))
    assert resumed.steps_done == 1
    assert read_consumed(config, role.paths, committed) == ["shard-a"]
    served = fetch_policy(config, committed, tmp_path / "rollout-cache")
    assert (served / "model.safetensors").is_file()
    assert not [p.name for p in served.iterdir() if is_trainer_state_file(p.name)]
    assert not (served / "consumed_shards.json").exists()


@pytest.mark.parametrize("storage", ["file", "memory"])
def test_the_reward_role_reads_the_tokenizer_and_never_a_weight_file(
    local_run_config, tmp_path, tiny_dir, storage
):
    from sluice.tasks.reward.role import RewardRole

    overrides = [] if storage == "file" else [f"storage.url=memory://tok-{tmp_path.name}"]
    config = local_run_config(tmp_path, *overrides)
    role = RewardRole(config, "run", mlflow_run_id="")
    role.registry.commit(0, save_checkpoint(tiny_dir, role.paths.checkpoint(0)))
    # The weights become unreadable on storage: any reader of them would fail here.
    fs, path = open_filesystem(role.paths.checkpoint(0), config.storage.options)
    fs.rm_file(f"{path}/model.safetensors")

    local = role.fetch_tokenizer()

    tokenizer = load_policy_tokenizer(local)
    assert tokenizer.decode(tokenizer.encode("1+2")).replace(" ", "").endswith("1+2")
    if storage == "memory":  # a copy: exactly the tokenizer's files came down
        copied = {p.name for p in local.iterdir()} - {"sluice_manifest.json"}
        assert "tokenizer.json" in copied
        assert not [name for name in copied if name.endswith((".safetensors", ".pt", ".bin"))]


def test_every_saved_version_carries_version_zeros_tokenizer_files_byte_for_byte(
    tiny_dir: Path, tmp_path: Path
):
    # A chat template inside tokenizer_config.json, where the importer writes it: saving
    # the loaded tokenizer again would move it to chat_template.jinja and rewrite the config.
    source = tmp_path / "v0"
    source.mkdir()
    for path in tiny_dir.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    trainer = make_trainer(source)
    trainer.train_step(batch(len(trainer.tokenizer)))
    saved = trainer.save(tmp_path / "v1", state_dir=tmp_path / "state")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (saved / name).read_bytes() == (source / name).read_bytes(), name
    assert not (saved / "chat_template.jinja").exists()
    assert load_policy_tokenizer(saved).chat_template == tokenizer_config["chat_template"]
