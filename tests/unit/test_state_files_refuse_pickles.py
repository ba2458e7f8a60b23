"""A trainer state file is data, never code: a pickle planted in its place is refused.

Trainer state comes back from storage (a resuming trainer fetches it), so whoever can
write the bucket can replace it. Each test plants a pickle whose ``__reduce__`` creates a
file, in place of one state file (the torch optimizer state and one of its parts, the
minibatch RNG, the Megatron optimizer state), resumes a real trainer from it, and
asserts the load is refused and the file never appears. A control load without
``weights_only`` shows the payload is live.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.train_batch import TrainerSettings
from sluice.engines.rl.trainer import PolicyTrainer
from sluice.engines.rl.trainer_files import (
    OPTIMIZER_FILE,
    RNG_STATE_FILE,
    load_optimizer_state,
    optimizer_part_file,
    save_optimizer_state,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class PlantsAFile:
    """Unpickling this opens (creates) `marker`: code run by the loader."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def _plant(path: Path, marker: Path) -> None:
    torch.save({"state": {}, "param_groups": [], "payload": PlantsAFile(marker)}, path)


def _payload_is_live(path: Path, marker: Path) -> None:
    """The planted file really runs code when loaded the unsafe way (then clean up)."""
    probe = marker.with_name("probe")
    _plant(path.with_name("probe.pt"), probe)
    torch.load(path.with_name("probe.pt"), weights_only=False)
    assert probe.exists()
    probe.unlink()
    path.with_name("probe.pt").unlink()


def _trainer(model_dir: Path) -> PolicyTrainer:
    return PolicyTrainer(model_dir, TrainerSettings(lr=1e-3, seed=7), make_policy_loss(), None)


@pytest.mark.parametrize("planted", [OPTIMIZER_FILE, RNG_STATE_FILE])
def test_a_resuming_trainer_refuses_a_planted_pickle(tiny_dir, tmp_path, planted):
    saved = tmp_path / "v1"
    _trainer(tiny_dir).save(saved)
    assert (saved / planted).is_file()
    marker = tmp_path / "pwned"
    _plant(saved / planted, marker)
    _payload_is_live(saved / planted, marker)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _trainer(saved)
    assert not marker.exists()


def test_an_optimizer_part_file_refuses_a_planted_pickle(tmp_path, monkeypatch):
    import sluice.engines.rl.trainer_files as files

    monkeypatch.setattr(files, "OPTIMIZER_PART_BYTES", 1 << 12)  # 4 KiB parts
    state = {"state": {i: {"exp_avg": torch.zeros(1024)} for i in range(4)}, "param_groups": []}
    save_optimizer_state(state, tmp_path)
    assert (tmp_path / optimizer_part_file(1)).is_file()
    assert load_optimizer_state(tmp_path / OPTIMIZER_FILE, "cpu")["state"].keys() == {0, 1, 2, 3}
    marker = tmp_path / "pwned"
    _plant(tmp_path / optimizer_part_file(1), marker)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_optimizer_state(tmp_path / OPTIMIZER_FILE, "cpu")
    assert not marker.exists()


@pytest.fixture
def fresh_parallel_state() -> Iterator[None]:
    from megatron.core import parallel_state

    started_here = not torch.distributed.is_initialized()
    yield
    parallel_state.destroy_model_parallel()
    if started_here and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.usefixtures("fresh_parallel_state")
def test_a_megatron_trainer_refuses_a_planted_optimizer_pickle(tmp_path):
    from sluice.engines.megatron.trainer import MegatronPolicyTrainer
    from tests.unit.synthetic import SHIPPED

    def megatron(model_dir: Path) -> MegatronPolicyTrainer:
        return MegatronPolicyTrainer(model_dir, TrainerSettings(lr=1e-3), make_policy_loss(), None)

    saved = megatron(SHIPPED).save(tmp_path / "v1")
    state_dir = saved if (saved / OPTIMIZER_FILE).is_file() else tmp_path / "v1"
    assert (state_dir / OPTIMIZER_FILE).is_file()
    marker = tmp_path / "pwned"
    _plant(state_dir / OPTIMIZER_FILE, marker)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        megatron(state_dir)
    assert not marker.exists()
