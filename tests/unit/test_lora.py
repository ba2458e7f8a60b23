"""LoRA on the torch trainer (`trainer.lora`): only the adapters train, a version is the
adapter alone (PEFT's files), merged it is the model the trainer holds, and a trainer
resumed from the base and the adapter is the one that saved."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sluice.engines.policy.adapter import merge_adapter_dir, read_adapter
from sluice.engines.policy.model import load_policy_dir
from sluice.engines.rl.lora import LoraError, LoraSettings
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.rollout_correction import make_rollout_correction
from sluice.engines.rl.train_batch import TrainerSettings, TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer
from sluice.engines.rl.trainer_files import ADAPTER_DIR
from tests.unit.synthetic import SHIPPED, random_samples

SETTINGS = TrainerSettings(ppo_minibatches=2, max_tokens_per_micro_batch=200, lr=1e-2)
LORA = LoraSettings(rank=4, alpha=8)


def samples(seed: int) -> list[TrainingSample]:
    return random_samples(seed, n=16, prompt_len=10, max_response=30)


def trainer(model_dir: Path = SHIPPED, lora: LoraSettings | None = LORA) -> PolicyTrainer:
    return PolicyTrainer(
        model_dir,
        SETTINGS,
        make_policy_loss(),
        make_rollout_correction(mode="token_tis"),
        lora=lora,
    )


def logits(model: torch.nn.Module) -> torch.Tensor:
    """One sequence's logits (with the packed-attention boundaries the trainer's model
    needs; a plain model's attention ignores them)."""
    ids = torch.tensor([[1, 5, 9, 12, 3, 4, 7, 8]])
    bounds = torch.tensor([0, 8], dtype=torch.int32)
    packed = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": 8}
    with torch.no_grad():
        return model(
            input_ids=ids,
            position_ids=torch.arange(8)[None],
            use_cache=False,
            **packed,
            max_length_k=8,
        ).logits


def test_only_the_adapters_train_and_enter_the_optimizer() -> None:
    lora = trainer()
    full = trainer(lora=None)
    adapted = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert adapted and all(".lora_A." in n or ".lora_B." in n for n in adapted)
    in_optimizer = sum(p.numel() for g in lora.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for n, p in lora.model.named_parameters() if n in adapted)
    assert in_optimizer < sum(p.numel() for p in full.model.parameters()) / 10
    # A fresh adapter computes what the base computes (B = 0).
    torch.testing.assert_close(logits(lora.model), logits(full.model), rtol=0, atol=0)
    frozen = {n: p.detach().clone() for n, p in lora.model.named_parameters() if n not in adapted}
    before = {n: p.detach().clone() for n, p in lora.model.named_parameters() if n in adapted}
    metrics = lora.train_step(samples(0))
    assert np.isfinite(metrics["loss/policy_loss"])
    after = dict(lora.model.named_parameters())
    assert all(torch.equal(frozen[n], after[n]) for n in frozen)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def resume_dir(base: Path, policy: Path, state: Path, into: Path) -> Path:
    """What a resuming LoRA trainer is given (tasks/run/versions.py): the base and the
    trainer state side by side, the adapter version in `ADAPTER_DIR`."""
    into.mkdir()
    for source in (base, state):
        for path in source.iterdir():
            (into / path.name).symlink_to(path.resolve())
    (into / ADAPTER_DIR).symlink_to(policy.resolve())
    return into


def test_a_version_is_the_adapter_alone_and_merges_into_a_plain_model(tmp_path: Path) -> None:
    lora = trainer()
    for step in range(2):
        lora.train_step(samples(step))
    out = lora.save(tmp_path / "v2", state_dir=tmp_path / "state")
    # PEFT's two files, nothing of the base (no config.json, weights or tokenizer).
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert {p.name for p in (tmp_path / "state").iterdir()} == {
        "optimizer.pt",
        "trainer_rng.pt",
        "trainer_state.json",
    }
    adapter = read_adapter(out)
    assert adapter.scale == LORA.alpha / LORA.rank
    plain, _ = load_policy_dir(merge_adapter_dir(SHIPPED, out, tmp_path / "merged"))
    # Merged W + (alpha / r) B A against the adapter applied at run time, in float32.
    torch.testing.assert_close(logits(plain), logits(lora.model), rtol=1e-5, atol=1e-5)


def test_a_resumed_trainer_goes_on_exactly_as_the_one_that_saved(tmp_path: Path) -> None:
    first = trainer()
    first.train_step(samples(0))
    out = first.save(tmp_path / "v1", state_dir=tmp_path / "state")
    resumed = trainer(resume_dir(SHIPPED, out, tmp_path / "state", tmp_path / "resume"))
    torch.testing.assert_close(logits(resumed.model), logits(first.model), rtol=0, atol=0)
    a, b = first.train_step(samples(1)), resumed.train_step(samples(1))
    assert a["loss/policy_loss"] == b["loss/policy_loss"]
    assert a["train/grad_norm"] == b["train/grad_norm"]
    for (name, p), (_, q) in zip(
        first.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name


def test_a_resume_under_other_lora_settings_is_refused(tmp_path: Path) -> None:
    out = trainer().save(tmp_path / "v1", state_dir=tmp_path / "state")
    where = resume_dir(SHIPPED, out, tmp_path / "state", tmp_path / "resume")
    with pytest.raises(LoraError, match="resume it with the same settings"):
        trainer(where, LoraSettings(rank=8, alpha=8))


def test_target_modules_the_model_lacks_and_a_rank_too_large_are_refused() -> None:
    with pytest.raises(LoraError) as caught:
        trainer(lora=LoraSettings(rank=4, target_modules=("q_proj", "qkv")))
    message = str(caught.value)
    assert "has no qkv" in message and "q_proj" in message and "\n" not in message
    with pytest.raises(LoraError, match=r"rank=100000 is larger than the smallest adapted layer"):
        trainer(lora=LoraSettings(rank=100000))


def test_lora_with_the_megatron_backend_is_refused_in_one_line() -> None:
    from sluice.infra.config.overrides import ConfigError
    from sluice.infra.config.run import load_config

    with pytest.raises(ConfigError, match="trainer.lora trains adapters with the torch backend"):
        load_config(None, ["trainer.lora.rank=8", "trainer.backend=megatron"])
    assert load_config(None, ["trainer.lora.rank=8"]).trainer.lora.rank == 8


def test_the_cli_refuses_modules_the_model_lacks_before_anything_runs(tmp_path, capsys) -> None:
    from sluice.flows.cli import main

    code = main(
        ["train", "--set", f"workdir={tmp_path}", "--set", f"model.path={SHIPPED}"]
        + ["--set", "trainer.lora.rank=4", "--set", "trainer.lora.target_modules=[qkv]"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "trainer.lora.target_modules ['qkv']: the model has no qkv" in err[0]
    assert list(tmp_path.iterdir()) == []
