"""A trainer reloaded from its own checkpoint continues exactly where it stopped: the seeded
minibatch order, the optimizer moments and the step count all come back, so a restarted
(or Prefect-retried) seeded run logs the same losses as an uninterrupted one."""

import numpy as np
import pytest
import torch

from engines.loss import make_policy_loss
from engines.model import build_tiny_policy
from engines.trainer import PolicyTrainer, TrainerSettings, TrainingSample


@pytest.fixture(scope="module", autouse=True)
def fixed_threads():
    # Bit-exact comparisons hold at one thread count; pin it for the whole module.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_policy(
        tmp_path_factory.mktemp("tiny") / "policy",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        seed=0,
    )


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
