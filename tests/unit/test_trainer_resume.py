"""A trainer reloaded from its own checkpoint continues exactly where it stopped: the seeded
minibatch order, the optimizer moments and the step count all come back, so a restarted
(or Prefect-retried) seeded run logs the same losses as an uninterrupted one."""

import numpy as np
import pytest

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
