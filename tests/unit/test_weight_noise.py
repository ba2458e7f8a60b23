"""Injected train–inference mismatch: the inference engine perturbs the weights it loads,
reproducibly per (seed, weight version), and leaves them exact at σ = 0."""

import numpy as np
import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationRequest, SamplingParams
from sluice.engines.inference.weights import perturb_weights
from sluice.engines.policy.model import load_policy_dir
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.train_batch import TrainerSettings, TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer

TOKENS = torch.tensor([[1, 10, 11, 12, 20, 21, 30, 31, 5]])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine_logits(model_dir, **kwargs):
    engine = InferenceEngine(model_dir, max_batch_size=2, **kwargs)
    with torch.no_grad():
        logits = engine.model(TOKENS).logits
    return engine, logits


def trainer_logits(model_dir):
    model, _ = load_policy_dir(model_dir)
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def test_perturb_weights_is_relative_to_each_tensor_and_spares_integers_and_constants():
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "big": 3.0 * torch.randn(200, 200, generator=gen),
        "norm": torch.ones(16),
        "steps": torch.arange(5),
        "half": torch.randn(64, generator=gen).to(torch.bfloat16),
    }
    noisy = perturb_weights(tensors, 0.1, seed=0, weight_version=0)
    # std(noise) = 0.1 · std(w) = 0.3 for the 3-sigma tensor (40,000 draws: ±1%).
    assert float((noisy["big"] - tensors["big"]).std()) == pytest.approx(0.3, rel=0.02)
    assert torch.equal(noisy["norm"], tensors["norm"])  # std 0: nothing to scale
    assert torch.equal(noisy["steps"], tensors["steps"])
    assert noisy["half"].dtype == torch.bfloat16
    assert perturb_weights(tensors, 0.0, seed=0, weight_version=0) is tensors


def test_perturb_weights_noise_depends_on_seed_version_and_name_only():
    w = torch.randn(50, generator=torch.Generator().manual_seed(1))
    first = perturb_weights({"a": w, "b": w}, 0.1, seed=3, weight_version=2)
    alone = perturb_weights({"a": w}, 0.1, seed=3, weight_version=2)
    assert torch.equal(first["a"], alone["a"])  # other tensors do not shift the stream
    assert not torch.equal(first["a"], first["b"])
    assert not torch.equal(
        first["a"], perturb_weights({"a": w}, 0.1, seed=4, weight_version=2)["a"]
    )
    assert not torch.equal(
        first["a"], perturb_weights({"a": w}, 0.1, seed=3, weight_version=3)["a"]
    )


def test_engine_without_noise_computes_the_trainers_logits_exactly(tiny_dir):
    engine, logits = engine_logits(tiny_dir, seed=0)
    engine.shutdown()
    assert torch.equal(logits, trainer_logits(tiny_dir))


def test_engine_noise_changes_logits_reproducibly_per_seed_and_version(tiny_dir):
    clean = trainer_logits(tiny_dir)
    first, noisy = engine_logits(tiny_dir, seed=7, weight_noise_std=0.05)
    second, again = engine_logits(tiny_dir, seed=7, weight_noise_std=0.05)
    other_seed, other = engine_logits(tiny_dir, seed=8, weight_noise_std=0.05)
    other_seed.shutdown()
    assert not torch.allclose(noisy, clean, atol=1e-3)
    assert torch.equal(noisy, again)
    assert not torch.allclose(noisy, other, atol=1e-3)

    # Reloading the same checkpoint as a new version draws fresh noise; loading it
    # back as the first version draws the first noise again.
    first.update_weights_from_disk(tiny_dir, 1)
    with torch.no_grad():
        next_version = first.model(TOKENS).logits
    assert not torch.allclose(next_version, noisy, atol=1e-3)
    assert not torch.allclose(next_version, clean, atol=1e-3)
    second.update_weights_from_disk(tiny_dir, 1)
    with torch.no_grad():
        assert torch.equal(second.model(TOKENS).logits, next_version)
    first.update_weights_from_disk(tiny_dir, 0)
    with torch.no_grad():
        assert torch.equal(first.model(TOKENS).logits, noisy)
    first.shutdown()
    second.shutdown()


def test_noisy_behaviour_logprobs_disagree_with_the_clean_trainer(tiny_dir):
    # What the trainer logs as mismatch/kl_k3: ~0 without noise, clearly > 0 with it.
    requests = [
        GenerationRequest(
            prompt_token_ids=[1, 10 + i, 20 + i, 30],
            sampling=SamplingParams(max_new_tokens=16, temperature=1.0, seed=i),
        )
        for i in range(4)
    ]
    trainer = PolicyTrainer(tiny_dir, TrainerSettings(lr=1e-3), make_policy_loss(), None)
    k3 = {}
    for std in (0.0, 0.1):
        engine = InferenceEngine(tiny_dir, max_batch_size=4, seed=0, weight_noise_std=std)
        outputs = engine.generate(requests)
        engine.shutdown()
        samples = [
            TrainingSample(list(o.prompt_token_ids), o.output_token_ids, o.behaviour_logprobs, 0.0)
            for o in outputs
        ]
        delta = np.concatenate(trainer.response_logprobs(samples)) - np.concatenate(
            [o.behaviour_logprobs for o in outputs]
        )
        k3[std] = float(np.mean(np.exp(delta) - delta - 1))
    assert k3[0.0] < 1e-8
    assert k3[0.1] > 1e-4, k3


def test_engine_rejects_a_negative_noise_std(tiny_dir):
    with pytest.raises(ValueError, match="weight_noise_std"):
        InferenceEngine(tiny_dir, weight_noise_std=-0.1)
