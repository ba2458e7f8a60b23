"""A checkpoint written later from `PolicyTrainer.save_later`'s copy is the checkpoint
`save` writes now, byte for byte, whatever the trainer did in between."""

import hashlib
from pathlib import Path

import torch

from sluice.infra.config import load_config
from sluice.tasks.training import build_trainer


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
