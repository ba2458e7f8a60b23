"""A checkpoint written later from `PolicyTrainer.save_later`'s copy is the checkpoint
`save` writes now, byte for byte, whatever the trainer did in between."""

import hashlib
from pathlib import Path

import pytest
import torch

from sluice.engines.rl import trainer_files
from sluice.infra.config.run import load_config
from sluice.tasks.train.base import build_trainer


def digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def step(trainer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in trainer.model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    trainer.optimizer.step()


def test_a_deferred_save_writes_the_files_save_wrote_before_the_next_step(tiny_dir, tmp_path):
    trainer = build_trainer(load_config("default", []), tiny_dir)
    step(trainer, 0)  # fills the optimizer's moments
    write = trainer.save_later()
    assert write is not None
    trainer.save(tmp_path / "now", state_dir=tmp_path / "now-state", extra={"policy_version": 1})
    step(trainer, 1)  # the next step changes weights and moments in place
    write(tmp_path / "later", state_dir=tmp_path / "later-state", extra={"policy_version": 1})
    assert digests(tmp_path / "now") == digests(tmp_path / "later")
    assert digests(tmp_path / "now-state") == digests(tmp_path / "later-state")
    # and the copy the fast weight paths send is the weights of that moment
    saved = torch.load(tmp_path / "now-state" / "optimizer.pt", weights_only=True)
    assert saved["state"]  # moments were written, not an empty optimizer


def test_a_lora_trainer_saves_only_now(tiny_dir):
    trainer = build_trainer(load_config("default", ["trainer.lora.rank=2"]), tiny_dir)
    assert trainer.save_later() is None


def test_optimizer_parts_split_per_parameter_state_once_a_part_is_full():
    # Three parameters, each {exp_avg: 4 float32, exp_avg_sq: 4 float32, step: 1 float32}
    # = 16 + 16 + 4 = 36 bytes, 108 in all. Parts of at most 60 bytes: ceil(108 / 60) = 2
    # parts, a share of 54 each. Parameter 0 leaves the first part at 36 (< 54), so
    # parameter 1 joins it (72 >= 54); parameter 2 starts the second.
    def moments() -> dict[str, torch.Tensor]:
        return {"step": torch.tensor(1.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}

    state = {"state": {0: moments(), 1: moments(), 2: moments()}, "param_groups": [{"lr": 1.0}]}
    first, second = trainer_files.optimizer_parts(state, part_bytes=60)
    assert sorted(first["state"]) == [0, 1] and sorted(second["state"]) == [2]
    assert first["param_groups"] == [{"lr": 1.0}] and first[trainer_files.PARTS_KEY] == 2
    assert set(second) == {"state"}
    # Parts of 40 bytes: three, a share of 36 each, so one parameter a part.
    assert [sorted(p["state"]) for p in trainer_files.optimizer_parts(state, 40)] == [[0], [1], [2]]
    # 108 bytes fit one part of 108: the state dict comes back as it was, no count added.
    assert trainer_files.optimizer_parts(state, part_bytes=108) == [state]


def test_a_trainer_state_in_parts_resumes_the_same_optimizer_and_a_missing_part_is_refused(
    tiny_dir, tmp_path, monkeypatch
):
    config = load_config("default", [])
    trainer = build_trainer(config, tiny_dir)
    step(trainer, 0)
    whole = tmp_path / "whole"
    trainer.save(whole)
    monkeypatch.setattr(trainer_files, "OPTIMIZER_PART_BYTES", 4096)
    write = trainer.save_later()
    trainer.save(tmp_path / "now")
    step(trainer, 1)
    write(tmp_path / "later")
    parts = sorted(p.name for p in (tmp_path / "now").glob("optimizer*.pt"))
    assert len(parts) > 2 and "optimizer.part1.pt" in parts, parts
    assert digests(tmp_path / "now") == digests(tmp_path / "later")
    assert not list(whole.glob("optimizer.part*.pt"))  # under 256 MiB: one file, as before

    resumed = build_trainer(config, tmp_path / "now").optimizer.state_dict()
    expected = build_trainer(config, whole).optimizer.state_dict()
    assert resumed["param_groups"] == expected["param_groups"]
    assert sorted(resumed["state"]) == sorted(expected["state"])
    for key, moments in expected["state"].items():
        for name, value in moments.items():
            assert torch.equal(resumed["state"][key][name], value), (key, name)

    (tmp_path / "now" / "optimizer.part1.pt").unlink()
    with pytest.raises(
        FileNotFoundError, match="optimizer.part1.pt: the trainer state is incomplete"
    ):
        build_trainer(config, tmp_path / "now")
