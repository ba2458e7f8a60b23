"""The objectives' config keys: each reaches the trainer, and every refused combination
is refused in one line that names what to change."""

import pytest
import torch

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import load_config
from sluice.tasks.train.base import reward_shaping
from sluice.tasks.train.factory import trainer_settings


def test_every_objective_key_reaches_the_trainer_settings():
    config = load_config(
        "default",
        [
            "trainer.ppo_epochs=3",
            "trainer.loss.proximal=loglinear",
            "trainer.loss.loss_agg_mode=seq-mean-token-sum",
            "trainer.loss.entropy_coef=0.01",
            "trainer.kl.coef=0.05",
            "trainer.kl.estimator=k1",
            "trainer.lr_warmup_steps=4",
            "trainer.lr_decay=cosine",
            "trainer.lr_min_ratio=0.1",
            "trainer.total_steps=30",
        ],
    )
    settings = trainer_settings(config)
    assert (settings.ppo_epochs, settings.proximal, settings.loss_agg_mode) == (
        3,
        "loglinear",
        "seq-mean-token-sum",
    )
    assert (settings.entropy_coef, settings.kl_coef, settings.kl_estimator) == (0.01, 0.05, "k1")
    assert (settings.lr_warmup_steps, settings.lr_decay, settings.lr_min_ratio) == (
        4,
        "cosine",
        0.1,
    )
    assert settings.total_steps == 30


def test_the_overlong_penalty_is_shaped_from_the_rollout_cap():
    config = load_config(
        "default",
        [
            "rollout.max_new_tokens=20",
            "reward.overlong_buffer_tokens=5",
            "reward.overlong_penalty=0.5",
        ],
    )
    shape = reward_shaping(config)
    assert shape is not None
    # L_max = 20, L_cache = 5: free up to 15 tokens, then 0.5 * (15 - |y|) / 5.
    assert shape(torch.tensor([10, 15, 17, 20])).tolist() == pytest.approx([0.0, 0.0, -0.2, -0.5])
    assert reward_shaping(load_config("default", [])) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.backend=megatron", "trainer.loss.proximal=loglinear"],
            "trainer.loss.proximal=loglinear needs trainer.backend=torch",
        ),
        (["trainer.backend=megatron", "trainer.kl.coef=0.1"], "trainer.kl.coef > 0 needs"),
        (["trainer.backend=megatron", "trainer.lr_decay=linear"], "an lr schedule needs"),
        (
            ["trainer.lr_warmup_steps=3", "trainer.total_steps=1"],
            "trainer.lr_warmup_steps=3 is longer than the run (trainer.total_steps=1)",
        ),
        (
            ["trainer.loss.objective=gspo", "trainer.loss.dual_clip_c=3"],
            "gspo has no such term",
        ),
        (
            ["trainer.loss.proximal=loglinear", "trainer.lora.rank=4", "trainer.lora.dropout=0.1"],
            "needs trainer.lora.dropout=0",
        ),
        (
            ["rollout.max_new_tokens=16", "reward.overlong_buffer_tokens=16"],
            "must be below rollout.max_new_tokens=16",
        ),
        (["trainer.correction.icepop_upper=0.9"], "icepop_upper"),
        (["trainer.loss.loss_agg_mode=seq-sum"], "loss_agg_mode"),
    ],
)
def test_a_refused_combination_gets_one_line(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config("default", overrides)
    text = str(caught.value)
    assert message in text and "\n" not in text.strip(), text
