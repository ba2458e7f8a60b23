"""``trainer.backend: megatron`` trains like the torch backend and publishes HF directories."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engines.inference.weights import read_weight_files
from sluice.engines.megatron.trainer import MegatronPolicyTrainer
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.rollout_correction import make_rollout_correction
from sluice.engines.rl.train_batch import TrainerSettings
from sluice.engines.rl.trainer import PolicyTrainer
from tests.unit.synthetic import SHIPPED
from tests.unit.synthetic import random_samples as _samples

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def fresh_parallel_state() -> Iterator[None]:
    from megatron.core import parallel_state

    started_here = not torch.distributed.is_initialized()
    yield
    parallel_state.destroy_model_parallel()
    if started_here and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# Two PPO minibatches, several micro-batches each, token-level TIS: every shared path runs.
SETTINGS = TrainerSettings(ppo_minibatches=2, max_tokens_per_micro_batch=200, lr=1e-3)


def _trainer(cls: type[PolicyTrainer], model_dir: Path = SHIPPED, **kwargs: Any) -> PolicyTrainer:
    return cls(
        model_dir, SETTINGS, make_policy_loss(), make_rollout_correction(mode="token_tis"), **kwargs
    )


def test_megatron_and_torch_backends_agree_over_three_steps() -> None:
    """Same start, same batches: the same losses, grad norms and (within 1e-5) weights."""
    torch_trainer = _trainer(PolicyTrainer)
    megatron_trainer = _trainer(MegatronPolicyTrainer)
    for step in range(3):
        samples = _samples(step)
        ours, theirs = megatron_trainer.train_step(samples), torch_trainer.train_step(samples)
        assert ours["train/micro_batches"] == theirs["train/micro_batches"] > 2
        for key in ("loss/policy_loss", "train/grad_norm", "mismatch/kl_k3", "policy/entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), (step, key)
    trained = megatron_trainer.hf_state_dict()
    start = read_weight_files(SHIPPED)
    for name, param in torch_trainer.model.named_parameters():
        if name in trained:
            torch.testing.assert_close(trained[name], param.detach(), rtol=0, atol=1e-5)
    assert max(float((trained[n] - start[n]).abs().max()) for n in start) > 1e-3


@pytest.mark.parametrize(
    ("objective", "settings"),
    [
        ("gspo", {"loss_agg_mode": "seq-mean-token-mean", "entropy_coef": 0.01, "ppo_epochs": 2}),
        ("cispo", {"loss_agg_mode": "seq-mean-token-sum"}),
    ],
)
def test_the_objectives_beyond_ppo_train_alike_on_both_backends(
    objective: str, settings: dict[str, Any]
) -> None:
    """The shared loss code (objective, aggregation, entropy bonus, epochs) runs inside
    Megatron's schedule as in the torch step; Megatron keeps its π_prox pass, torch
    takes π_prox from the first minibatch's forward, and the updates still agree."""
    import dataclasses

    chosen = dataclasses.replace(SETTINGS, **settings)
    loss = make_policy_loss(objective, eps_clip_low=0.2, eps_clip_high=0.2)
    correction = make_rollout_correction(mode="token_tis")
    torch_trainer = PolicyTrainer(SHIPPED, chosen, loss, correction)
    megatron_trainer = MegatronPolicyTrainer(SHIPPED, chosen, loss, correction)
    for step in range(2):
        samples = _samples(step)
        ours, theirs = megatron_trainer.train_step(samples), torch_trainer.train_step(samples)
        assert ours["train/optimizer_steps"] == theirs["train/optimizer_steps"]
        assert ours["train/proximal_pass_tokens"] > theirs["train/proximal_pass_tokens"]
        for key in ("loss/policy_loss", "train/grad_norm", "policy/entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), (step, key)
    trained = megatron_trainer.hf_state_dict()
    for name, param in torch_trainer.model.named_parameters():
        if name in trained:
            torch.testing.assert_close(trained[name], param.detach(), rtol=0, atol=1e-5)


def test_a_megatron_version_saves_as_an_hf_directory_and_resumes_exactly(tmp_path: Path) -> None:
    trainer = _trainer(MegatronPolicyTrainer)
    trainer.train_step(_samples(0))
    saved = trainer.save(tmp_path / "v1")
    # The published directory is plain HF weights, equal to the Megatron model's.
    on_disk = read_weight_files(saved)
    for name, tensor in trainer.hf_state_dict().items():
        assert torch.equal(on_disk[name], tensor), name
    # A trainer started from it continues as the one that wrote it (optimizer, RNG).
    resumed = _trainer(MegatronPolicyTrainer, saved)
    assert resumed.steps_done == 1
    ours, theirs = resumed.train_step(_samples(1)), trainer.train_step(_samples(1))
    assert ours["loss/policy_loss"] == pytest.approx(theirs["loss/policy_loss"], rel=1e-6)
    for name, tensor in trainer.hf_state_dict().items():
        torch.testing.assert_close(resumed.hf_state_dict()[name], tensor, rtol=0, atol=1e-6)


def test_a_version_resumes_only_under_the_backend_that_wrote_its_optimizer(
    tmp_path: Path,
) -> None:
    written_by_megatron = _trainer(MegatronPolicyTrainer).save(tmp_path / "megatron")
    written_by_torch = _trainer(PolicyTrainer).save(tmp_path / "torch")
    with pytest.raises(ValueError, match="resume it with trainer.backend=megatron"):
        _trainer(PolicyTrainer, written_by_megatron)
    with pytest.raises(ValueError, match="resume it with trainer.backend=torch"):
        _trainer(MegatronPolicyTrainer, written_by_torch)


def test_a_version_resumes_only_at_the_parallel_sizes_that_wrote_its_optimizer(
    tmp_path: Path,
) -> None:
    saved = _trainer(MegatronPolicyTrainer).save(tmp_path / "v0")
    state = json.loads((saved / "trainer_state.json").read_text())
    assert (state["tensor_parallel"], state["pipeline_parallel"]) == (1, 1)
    # As a version written by two pipeline stages records itself:
    state["pipeline_parallel"] = 2
    (saved / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(
        ValueError,
        match="trainer.tensor_parallel=1, trainer.pipeline_parallel=2, "
        "trainer.distributed_optimizer=False; resume it with those settings",
    ):
        _trainer(MegatronPolicyTrainer, saved)


def test_a_world_too_small_for_the_data_parallel_size_is_refused() -> None:
    with pytest.raises(ValueError, match="holds 1 data-parallel replicas, not data_parallel=2"):
        MegatronPolicyTrainer(SHIPPED, SETTINGS, make_policy_loss(), None, data_parallel=2)


def test_bf16_trains_on_fp32_main_weights_like_fp32_and_resumes_exactly(tmp_path: Path) -> None:
    """Megatron's mixed precision (``trainer.dtype: bfloat16``): the model in bf16, the
    optimizer on fp32 main copies. Three steps move the fp32 main weights the way the
    float32 torch backend moves its weights (the updates' cosine measured 0.976, their
    norms within 2%). The version is published in float32, which holds the bf16 weights
    and the float32 norms exactly, so it resumes exactly."""
    from sluice.engines.megatron import convert

    reference = _trainer(PolicyTrainer)
    trainer = _trainer(MegatronPolicyTrainer, SHIPPED, dtype=torch.bfloat16)
    optimizer = trainer.policy_optimizer.optimizer.chained_optimizers[0]
    assert type(optimizer).__name__ == "Float16OptimizerWithFloat16Params"
    projections = [p for n, p in trainer.megatron.named_parameters() if "linear" in n]
    assert {p.dtype for p in projections} == {torch.bfloat16}
    assert {p.main_param.dtype for p in projections} == {torch.float32}
    for step in range(3):
        trainer.train_step(_samples(step))
        reference.train_step(_samples(step))

    main = {n: getattr(p, "main_param", p).detach() for n, p in trainer.megatron.named_parameters()}
    ours = convert.megatron_to_hf(main, trainer.hf_config)
    start = read_weight_files(SHIPPED)
    theirs = {n: p.detach() for n, p in reference.model.named_parameters() if n in ours}
    our_update = torch.cat([(ours[n] - start[n]).flatten() for n in theirs])
    their_update = torch.cat([(theirs[n] - start[n]).flatten() for n in theirs])
    cosine = float(our_update @ their_update / (our_update.norm() * their_update.norm()))
    assert cosine > 0.9
    assert 0.8 < float(our_update.norm() / their_update.norm()) < 1.25

    saved = trainer.save(tmp_path / "v3")
    published = read_weight_files(saved)
    for name, tensor in trainer.hf_state_dict().items():
        assert torch.equal(published[name], tensor.float()), name
    resumed = _trainer(MegatronPolicyTrainer, saved, dtype=torch.bfloat16)
    next_resumed, next_continued = resumed.train_step(_samples(3)), trainer.train_step(_samples(3))
    assert next_resumed["loss/policy_loss"] == next_continued["loss/policy_loss"]
    for name, tensor in trainer.hf_state_dict().items():
        assert torch.equal(resumed.hf_state_dict()[name], tensor), name
