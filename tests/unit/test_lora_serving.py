"""A LoRA version served by Sluice's engine: folded into the base it was trained on, it
scores tokens as the trainer's π_prox does, each adapter applies to the base (never to
the adapter before it), and one that does not fit is refused with the old weights kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationRequest, SamplingParams, WeightLoadError
from sluice.engines.rl.lora import LoraSettings
from sluice.engines.rl.train_batch import TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer
from tests.unit.synthetic import SHIPPED
from tests.unit.test_lora import samples, trainer

TOLERANCE = 1e-4
"""Largest |engine log-prob - trainer log-prob| per token allowed (float32 on a CPU): the
engine multiplies by the merged W + s·BA, the trainer by W and then BA."""


def trained_adapter(tmp_path: Path, steps: int, seed: int = 0) -> tuple[PolicyTrainer, Path]:
    lora = trainer()
    for step in range(steps):
        lora.train_step(samples(seed + step))
    return lora, lora.save(tmp_path / f"adapter-{seed}-{steps}", state_dir=tmp_path / "state")


def sampled(engine: InferenceEngine) -> list[TrainingSample]:
    requests = [
        GenerationRequest(
            prompt_token_ids=[1, 5 + i, 9, 12 + i],
            sampling=SamplingParams(max_new_tokens=20, temperature=1.0, seed=i, ignore_eos=True),
        )
        for i in range(6)
    ]
    return [
        TrainingSample(list(o.prompt_token_ids), o.output_token_ids, o.behaviour_logprobs, 0.0)
        for o in engine.generate(requests)
    ]


def test_served_adapter_logprobs_equal_the_trainers_proximal_logprobs(tmp_path: Path) -> None:
    lora, adapter = trained_adapter(tmp_path, steps=3)
    engine = InferenceEngine(SHIPPED, max_batch_size=6, seed=0)
    try:
        base_samples = sampled(engine)
        report = engine.update_weights_from_disk(adapter, 3)
        adapted_samples = sampled(engine)
    finally:
        engine.shutdown()
    assert report.weight_version == 3 and engine.weight_version == 3
    for got in (base_samples, adapted_samples):
        assert sum(len(s.response_token_ids) for s in got) > 30
    behaviour = np.concatenate([s.behaviour_logprobs for s in adapted_samples])
    proximal = np.concatenate(lora.response_logprobs(adapted_samples))
    assert np.abs(behaviour - proximal).max() < TOLERANCE
    # The adapter matters: the base scores the same tokens measurably differently.
    base = PolicyTrainer(SHIPPED, lora.settings, lora.loss_fn, lora.correction_fn)
    assert np.abs(np.concatenate(base.response_logprobs(adapted_samples)) - behaviour).max() > 1e-2


def test_each_adapter_applies_to_the_base_not_to_the_adapter_before(tmp_path: Path) -> None:
    _, first = trained_adapter(tmp_path, steps=1, seed=0)
    _, second = trained_adapter(tmp_path, steps=2, seed=5)
    chained = InferenceEngine(SHIPPED, max_batch_size=2)
    direct = InferenceEngine(SHIPPED, max_batch_size=2)
    try:
        chained.update_weights_from_disk(first, 1)
        chained.update_weights_from_disk(second, 2)
        direct.update_weights_from_disk(second, 2)
        one, two = chained.model.state_dict(), direct.model.state_dict()
        assert all(torch.equal(one[name], two[name]) for name in one)
        # and a full checkpoint after adapters becomes the base of the next adapter
        chained.update_weights_from_disk(SHIPPED, 3)
        fresh = InferenceEngine(SHIPPED, max_batch_size=2)
        base = fresh.model.state_dict()
        assert all(torch.equal(chained.model.state_dict()[n], base[n]) for n in base)
        fresh.shutdown()
    finally:
        chained.shutdown()
        direct.shutdown()


def test_an_adapter_the_base_cannot_take_is_refused_and_the_weights_stay(
    tmp_path: Path,
) -> None:
    _, adapter = trained_adapter(tmp_path, steps=1)
    # Rename one adapted layer to a module this base does not have.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    renamed = {k.replace("layers.0.", "layers.99.", 1): v for k, v in tensors.items()}
    save_file(renamed, str(adapter / "adapter_model.safetensors"))
    engine = InferenceEngine(SHIPPED, max_batch_size=2)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        with pytest.raises(WeightLoadError) as caught:
            engine.update_weights_from_disk(adapter, 1)
        assert "does not fit the base model: it adapts model.layers.99." in str(caught.value)
        assert "\n" not in str(caught.value) and engine.weight_version == 0
        assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    finally:
        engine.shutdown()


def test_a_resumed_lora_trainer_is_refused_other_target_modules_in_one_line(
    tmp_path: Path,
) -> None:
    from sluice.engines.rl.lora import LoraError
    from tests.unit.test_lora import resume_dir

    _, adapter = trained_adapter(tmp_path, steps=1)
    where = resume_dir(SHIPPED, adapter, tmp_path / "state", tmp_path / "resume")
    with pytest.raises(LoraError, match="resume it with the same settings"):
        trainer(where, LoraSettings(rank=4, alpha=8, target_modules=("q_proj",)))
