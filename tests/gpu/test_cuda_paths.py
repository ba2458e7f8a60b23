"""The inference engine and the trainer step on CUDA: same contracts as on CPU.

Skipped without a CUDA device (CI has none); run on a GPU machine with
`python -m pytest -m gpu`.
"""

import numpy as np
import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationRequest, SamplingParams
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.rollout_correction import make_rollout_correction
from sluice.engines.rl.train_batch import TrainerSettings, TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def tiny_dir(tiny_policy):
    return tiny_policy(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        seed=0,
    )


def test_cuda_engine_and_trainer_agree_on_logprobs_and_the_step_follows_advantages(tiny_dir):
    engine = InferenceEngine(tiny_dir, max_batch_size=16, seed=0, device="cuda")
    requests = [
        GenerationRequest(
            prompt_token_ids=[1, 5 + i, 9, 12],
            sampling=SamplingParams(max_new_tokens=24, temperature=1.0, seed=i, ignore_eos=True),
        )
        for i in range(16)
    ]
    outputs = engine.generate(requests)
    engine.shutdown()
    trainer = PolicyTrainer(
        tiny_dir,
        TrainerSettings(lr=1e-3),
        make_policy_loss(),
        make_rollout_correction("token_tis", threshold=2.0),
        device="cuda",
    )
    samples = [
        TrainingSample(
            r.prompt_token_ids, o.output_token_ids, o.behaviour_logprobs, 1.0 if i % 2 else -1.0
        )
        for i, (r, o) in enumerate(zip(requests, outputs, strict=True))
    ]
    recomputed = trainer.response_logprobs(samples)
    gap = np.concatenate(
        [
            np.abs(np.asarray(o.behaviour_logprobs) - lp)
            for o, lp in zip(outputs, recomputed, strict=True)
        ]
    )
    assert gap.max() < 1e-3, gap.max()

    metrics = trainer.train_step(samples)
    after = trainer.response_logprobs(samples)
    change = [float((a - b).mean()) for a, b in zip(after, recomputed, strict=True)]
    assert all(c > 0 for c in change[1::2]) and all(c < 0 for c in change[0::2]), change
    assert metrics["mismatch/kl_k3"] < 1e-4
