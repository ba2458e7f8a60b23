"""The inference engine, the trainer step and the supervised pass on CUDA: same
contracts as on CPU.

Skipped without a CUDA device (CI has none); run on a GPU machine with
`python -m pytest -m gpu`.
"""

import numpy as np
import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationRequest, SamplingParams
from sluice.engines.policy.model import load_policy_dir
from sluice.engines.policy.supervised import supervised_pass
from sluice.engines.policy.warmstart import encode_supervised
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


def test_the_supervised_pass_hands_its_cuda_memory_back(tiny_policy, tmp_path):
    # The pass runs in the flow's own process, which lives on beside the roles for the
    # whole run: after it, nothing of its model, gradients or AdamW state stays reserved.
    # ~17M parameters: weights, gradients and two AdamW moments are ~270 MB of float32.
    model_dir = tiny_policy(
        hidden_size=512, num_layers=4, num_heads=8, intermediate_size=2048, seed=0
    )
    _, tokenizer = load_policy_dir(model_dir)
    rows = [encode_supervised(tokenizer, f"{i} + 3 =", str(i + 3)) for i in range(8)]
    torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")  # cuBLAS's workspace
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    reserved = torch.cuda.memory_reserved()
    report = supervised_pass(
        model_dir,
        iter(rows * 4),
        tmp_path / "out",
        minutes=5,
        max_steps=4,
        lr=1e-3,
        batch_size=8,
        device="cuda",
    )
    assert report.steps == 4 and (tmp_path / "out" / "config.json").is_file()
    assert torch.cuda.max_memory_reserved() - reserved > 200 * 2**20  # what it held
    assert torch.cuda.memory_reserved() - reserved < 16 * 2**20  # and gave back
