"""A trainer reloaded from its own checkpoint continues exactly where it stopped: the seeded
minibatch order, the optimizer moments and the step count all come back, so a restarted
(or Prefect-retried) seeded run logs the same losses as an uninterrupted one."""

import numpy as np
import pytest
import torch

from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.train_batch import TrainerSettings, TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_trainer(model_dir):
    # Two minibatches: the second optimizer step sees a seeded permutation of the batch.
    settings = TrainerSettings(lr=1e-3, ppo_minibatches=2, seed=7)
    return PolicyTrainer(model_dir, settings, make_policy_loss(), None)


def samples(vocab, n=8):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        response = rng.integers(4, vocab, size=int(rng.integers(2, 12)))
        out.append(
            TrainingSample(
                rng.integers(4, vocab, size=4),
                response,
                rng.normal(-3.0, 0.1, size=len(response)),
                1.0 if i % 3 else -1.0,
            )
        )
    return out


def test_a_trainer_reloaded_from_its_checkpoint_logs_the_uninterrupted_losses(tiny_dir, tmp_path):
    uninterrupted = make_trainer(tiny_dir)
    batch = samples(uninterrupted.model.config.vocab_size)
    expected = [uninterrupted.train_step(batch)["loss/policy_loss"] for _ in range(3)]

    first = make_trainer(tiny_dir)
    losses = [first.train_step(batch)["loss/policy_loss"]]
    first.save(tmp_path / "v1")
    resumed = make_trainer(tmp_path / "v1")
    assert resumed.steps_done == 1
    losses += [resumed.train_step(batch)["loss/policy_loss"] for _ in range(2)]

    assert losses == expected  # exact, not approx


def test_the_update_fence_is_passed_once_before_the_weights_change(tiny_dir):
    from tests.unit.test_publish_layout import batch, make_trainer

    trainer = make_trainer(tiny_dir)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    seen = []

    def fence():
        now = list(trainer.model.parameters())
        seen.append(all(torch.equal(a, b) for a, b in zip(now, before, strict=True)))

    trainer.update_fence = fence
    metrics = trainer.train_step(batch(trainer.model.config.vocab_size))
    # Two minibatches, two optimizer steps: the fence ran once, before the first.
    assert seen == [True] and trainer.update_fence is None
    assert "train/update_fence_wait_s" in metrics
    after = list(trainer.model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
