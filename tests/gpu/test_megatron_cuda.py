"""The Megatron backend on CUDA: bf16 with fp32 main weights and the distributed
optimizer, against the float32 torch backend.

Skipped without a CUDA device (CI has none); run on a GPU machine with
`python -m pytest -m gpu`. The same code paths run on CPU in
``tests/unit/test_megatron_trainer.py`` and ``tests/integration/test_megatron_parallel.py``.
"""

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_distributed_optimizer_on_cuda_tracks_the_float32_torch_backend(
    tmp_path: Path,
) -> None:
    pytest.importorskip("megatron.core", reason="needs megatron-core (the project's install)")
    from sluice.engines.inference.weights import read_weight_files
    from sluice.engines.megatron.trainer import MegatronPolicyTrainer
    from sluice.engines.rl.loss import make_policy_loss
    from sluice.engines.rl.rollout_correction import make_rollout_correction
    from sluice.engines.rl.trainer import PolicyTrainer
    from tests.unit.test_megatron_trainer import SETTINGS, SHIPPED, _samples

    def make(cls: type, model_dir: Path, **kwargs) -> PolicyTrainer:
        return cls(
            model_dir,
            SETTINGS,
            make_policy_loss(),
            make_rollout_correction(mode="token_tis"),
            device="cuda",
            **kwargs,
        )

    reference = make(PolicyTrainer, SHIPPED)
    trainer = make(MegatronPolicyTrainer, SHIPPED, dtype=torch.bfloat16, distributed_optimizer=True)
    assert type(trainer.policy_optimizer.optimizer.chained_optimizers[0]).__name__ == (
        "DistributedOptimizer"
    )
    for step in range(3):
        ours, theirs = trainer.train_step(_samples(step)), reference.train_step(_samples(step))
        assert ours["policy/entropy"] == pytest.approx(theirs["policy/entropy"], rel=0.05)
    start = read_weight_files(SHIPPED)
    ours = trainer.hf_state_dict()
    names = [n for n, _ in reference.model.named_parameters() if n in ours]
    our_update = torch.cat([(ours[n].float().cpu() - start[n]).flatten() for n in names])
    their_update = torch.cat(
        [(reference.model.get_parameter(n).detach().cpu() - start[n]).flatten() for n in names]
    )
    cosine = float(our_update @ their_update / (our_update.norm() * their_update.norm()))
    assert cosine > 0.8  # bf16 weights round each update; on CPU the fp32 mains give 0.976

    saved = trainer.save(tmp_path / "v3")
    resumed = make(MegatronPolicyTrainer, saved, dtype=torch.bfloat16, distributed_optimizer=True)
    next_resumed, next_continued = resumed.train_step(_samples(3)), trainer.train_step(_samples(3))
    assert next_resumed["loss/policy_loss"] == pytest.approx(
        next_continued["loss/policy_loss"], rel=1e-5
    )
