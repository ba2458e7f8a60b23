"""TRL's and verl's names in overrides: each sets the Sluice key of the same meaning and
says so once on stderr, or fails in one line saying how Sluice's meaning differs."""

import operator
from pathlib import Path

import pytest
from pydantic import BaseModel

from sluice.infra.config import peer_names
from sluice.infra.config.overrides import RENAMED_KEYS, ConfigError
from sluice.infra.config.peer_names import PEER_NAMES, VERL_PATHS
from sluice.infra.config.run import RunConfig, load_config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch):
    """Each test sees every notice: they are said once per name per process."""
    monkeypatch.setattr(peer_names, "_SAID", set())


def schema_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(f"{prefix}{name}")
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= schema_keys(annotation, f"{prefix}{name}.")
    return keys


@pytest.mark.parametrize(
    ("override", "key", "expected", "notice"),
    [
        (
            "learning_rate=1e-5",
            "trainer.lr",
            1e-5,
            "learning_rate is TRL's name; using trainer.lr=1e-5",
        ),
        ("lr=2e-6", "trainer.lr", 2e-6, "lr is verl's name; using trainer.lr=2e-6"),
        (
            "actor_rollout_ref.actor.optim.lr=3e-6",
            "trainer.lr",
            3e-6,
            "actor_rollout_ref.actor.optim.lr is verl's name; using trainer.lr=3e-6",
        ),
        ("num_generations=4", "rollout.group_size", 4, "using rollout.group_size=4"),
        ("rollout.n=16", "rollout.group_size", 16, "rollout.n is verl's name"),
        ("actor_rollout_ref.rollout.n=2", "rollout.group_size", 2, "using rollout.group_size=2"),
        ("max_completion_length=512", "rollout.max_new_tokens", 512, "TRL's name"),
        ("data.max_response_length=300", "rollout.max_new_tokens", 300, "verl's name"),
        (
            "max_steps=500",
            "trainer.total_steps",
            500,
            "TRL's optimizer steps are the same at num_iterations=1",
        ),
        ("trainer.total_training_steps=60", "trainer.total_steps", 60, "verl's name"),
        (
            "epsilon_high=0.28",
            "trainer.loss.eps_clip_high",
            0.28,
            "using trainer.loss.eps_clip_high=0.28",
        ),
        ("clip_ratio_low=0.1", "trainer.loss.eps_clip_low", 0.1, "verl's name"),
        ("clip_ratio_high=0.3", "trainer.loss.eps_clip_high", 0.3, "verl's name"),
        ("clip_ratio_c=3.0", "trainer.loss.dual_clip_c", 3.0, "using trainer.loss.dual_clip_c=3.0"),
        ("beta=0.04", "trainer.kl.coef", 0.04, "beta is TRL's name; using trainer.kl.coef=0.04"),
        ("kl_loss_coef=0.001", "trainer.kl.coef", 0.001, "on whenever > 0"),
        (
            "kl_loss_type=low_var_kl",
            "trainer.kl.estimator",
            "k3",
            "trainer.kl.estimator=k3 (for low_var_kl)",
        ),
        ("kl_loss_type=kl", "trainer.kl.estimator", "k1", "trainer.kl.estimator=k1 (for kl)"),
        ("kl_loss_type=mse", "trainer.kl.estimator", "k2", "trainer.kl.estimator=k2 (for mse)"),
        ("entropy_coeff=0.01", "trainer.loss.entropy_coef", 0.01, "verl's name"),
        (
            "loss_agg_mode=seq-mean-token-sum",
            "trainer.loss.loss_agg_mode",
            "seq-mean-token-sum",
            "using trainer.loss.loss_agg_mode=seq-mean-token-sum",
        ),
        ("loss_type=dapo", "trainer.loss.loss_agg_mode", "token-mean", "=token-mean (for dapo)"),
        ("loss_type=grpo", "trainer.loss.loss_agg_mode", "seq-mean-token-mean", "(for grpo)"),
        ("temperature=0.7", "rollout.temperature", 0.7, "TRL's and verl's name"),
        (
            "actor_rollout_ref.rollout.temperature=0.5",
            "rollout.temperature",
            0.5,
            "actor_rollout_ref.rollout.temperature is verl's name; using rollout.temperature=0.5",
        ),
        ("ppo_epochs=2", "trainer.ppo_epochs", 2, "verl's name"),
        ("num_iterations=3", "trainer.ppo_epochs", 3, "num_iterations is TRL's name"),
        ("warmup_steps=5", "trainer.lr_warmup_steps", 5, "TRL's name"),
        ("lr_warmup_steps=7", "trainer.lr_warmup_steps", 7, "verl's name"),
        ("lr_scheduler_type=cosine", "trainer.lr_decay", "cosine", "using trainer.lr_decay=cosine"),
        (
            "lr_scheduler_type=constant_with_warmup",
            "trainer.lr_decay",
            "constant",
            "(for constant_with_warmup)",
        ),
        (
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
            "trainer.lr_decay",
            "cosine",
            "verl's",
        ),
        ("min_lr_ratio=0.1", "trainer.lr_min_ratio", 0.1, "verl's name"),
        ("weight_decay=0.01", "trainer.weight_decay", 0.01, "using trainer.weight_decay=0.01"),
        ("max_grad_norm=0.5", "trainer.grad_clip", 0.5, "TRL's name"),
        ("grad_clip=2.0", "trainer.grad_clip", 2.0, "verl's name"),
        ("data.train_batch_size=32", "trainer.prompts_per_batch", 32, "verl's name"),
        ("ppo_max_token_len_per_gpu=4096", "trainer.max_tokens_per_micro_batch", 4096, "verl's"),
        (
            "use_kl_loss=false",
            "trainer.kl.coef",
            0.0,
            "using trainer.kl.coef=0 (the KL loss is off)",
        ),
        ("use_kl_loss=true", "trainer.kl.coef", 0.001, "verl's default kl_loss_coef"),
    ],
)
def test_a_peer_name_sets_the_sluice_key_and_says_so_once(override, key, expected, notice, capsys):
    config = load_config("default", [override])
    resolved = operator.attrgetter(key)(config)
    assert resolved == (expected if isinstance(expected, str) else pytest.approx(expected))
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("sluice: ") and notice in said[0]
    load_config("default", [override])  # a resumed run loads its config twice
    assert capsys.readouterr().err == ""


def test_seed_is_already_sluices_own_key(capsys):
    assert load_config("default", ["seed=7"]).seed == 7
    assert capsys.readouterr().err == ""


def test_epsilon_sets_both_clips_unless_the_upper_one_is_set(capsys):
    both = load_config("default", ["epsilon=0.1"]).trainer.loss
    assert (both.eps_clip_low, both.eps_clip_high) == (pytest.approx(0.1), pytest.approx(0.1))
    assert "using trainer.loss.eps_clip_low=0.1 and trainer.loss.eps_clip_high=0.1" in (
        capsys.readouterr().err
    )
    for order in (["epsilon_high=0.28", "epsilon=0.2"], ["epsilon=0.2", "epsilon_high=0.28"]):
        loss = load_config("default", order).trainer.loss
        assert (loss.eps_clip_low, loss.eps_clip_high) == (pytest.approx(0.2), pytest.approx(0.28))
    # reproduce.yaml sets eps_clip_high itself: verl's clip_ratio leaves it, and says so
    loss = load_config("reproduce", ["clip_ratio=0.1"]).trainer.loss
    assert (loss.eps_clip_low, loss.eps_clip_high) == (pytest.approx(0.1), pytest.approx(0.2))
    assert "trainer.loss.eps_clip_high is already set: 0.2" in capsys.readouterr().err


def test_use_kl_loss_keeps_a_coefficient_given_in_either_order():
    for order in (
        ["use_kl_loss=true", "kl_loss_coef=0.01"],
        ["kl_loss_coef=0.01", "use_kl_loss=true"],
    ):
        assert load_config("default", order).trainer.kl.coef == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "ppo_mini_batch_size=16",
            "--set ppo_mini_batch_size=16: verl's ppo_mini_batch_size is a size (prompts per "
            "optimizer step), Sluice's trainer.ppo_minibatches a count (optimizer steps per "
            "batch): set trainer.ppo_minibatches = train_batch_size / ppo_mini_batch_size",
        ),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=16", "verl's actor_rollout_ref.actor."),
        ("gradient_accumulation_steps=4", "trainer.max_tokens_per_micro_batch"),
        (
            "per_device_train_batch_size=8",
            "set trainer.prompts_per_batch = per_device_train_batch_size",
        ),
        (
            "generation_batch_size=64",
            "trainer.prompts_per_batch = generation_batch_size / num_generations",
        ),
        ("steps_per_generation=4", "trainer.ppo_minibatches = steps_per_generation"),
        ("ppo_micro_batch_size_per_gpu=2", "Sluice packs micro-batches by tokens"),
        (
            "max_prompt_length=512",
            "rollout.max_seq_len = max_prompt_length + rollout.max_new_tokens",
        ),
        ("data.max_prompt_length=512", "verl's data.max_prompt_length cuts prompts"),
        ("warmup_ratio=0.1", "trainer.lr_warmup_steps = warmup_ratio x trainer.total_steps"),
        ("trainer.total_epochs=3", "verl's trainer.total_epochs counts passes over a dataset"),
        ("loss_type=bnpo", "TRL's bnpo normalises by the tokens of each device's micro-batch"),
        ("loss_type=dr_grpo", "divided by max_completion_length; Sluice's trainer.loss"),
        ("loss_type=cispo", "caps the weight at epsilon_high itself"),
        ("loss_type=sapo", "Sluice has no such objective"),
        ("loss_type=mystery", "Sluice maps TRL's grpo and dapo"),
        (
            "loss_agg_mode=seq-mean-token-sum-norm",
            "Sluice's seq-mean-token-sum lacks that constant",
        ),
        ("kl_loss_type=abs", "verl's abs is |log r|"),
        ("kl_loss_type=low_var_kl+", "straight-through"),
        ("kl_loss_type=k4", "Sluice has verl's kl (k1), mse (k2) and low_var_kl (k3)"),
        ("lr_scheduler_type=cosine_with_min_lr", "trainer.lr_min_ratio"),
        (
            "lr_scheduler_type=polynomial",
            "Sluice's trainer.lr_decay has constant, linear and cosine",
        ),
        ("lr_warmup_steps=-1", "verl's -1 defers to lr_warmup_steps_ratio"),
        ("use_kl_loss=maybe", "verl's use_kl_loss takes true or false"),
    ],
)
def test_a_peer_name_whose_meaning_differs_is_refused_in_one_line(override, expected, capsys):
    with pytest.raises(ConfigError) as err:
        load_config("default", [override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "learning_rate=abc",
            "--set: invalid value for 'learning_rate' (TRL's name for 'trainer.lr') = \"abc\": "
            "Input should be a valid number",
        ),
        ("num_generations=0", "'num_generations' (TRL's name for 'rollout.group_size') = 0"),
        ("epsilon=2", "'epsilon' (TRL's name for 'trainer.loss.eps_clip_low') = 2"),
        (
            "loss_agg_mode=token-sum",
            "'loss_agg_mode' (verl's name for 'trainer.loss.loss_agg_mode')",
        ),
        ("max_grad_norm=0", "'max_grad_norm' (TRL's name for 'trainer.grad_clip') = 0"),
    ],
)
def test_a_bad_value_under_a_peer_name_names_both_names(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config("default", [override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["trainer.learning_rate=1e-5"],
            "did you mean 'trainer.lr'? (learning_rate is TRL's name for it)",
        ),
        (["trainer.loss.kl_loss_coef=0.1"], "did you mean 'trainer.kl.coef'?"),
        (
            ["trainer.loss.epsilon=0.1"],
            "'trainer.loss.eps_clip_low' and 'trainer.loss.eps_clip_high'",
        ),
        (["trainer.gradient_accumulation_steps=4"], "TRL's gradient_accumulation_steps counts"),
        (["trainer.lrr=1"], "did you mean 'trainer.lr'?"),
    ],
)
def test_an_unknown_key_ending_in_a_peer_name_suggests_its_sluice_key(overrides, expected):
    with pytest.raises(ConfigError, match="unknown config key") as err:
        load_config("default", overrides)
    assert expected in str(err.value)


def test_a_peer_name_in_a_config_file_is_an_unknown_key_naming_the_sluice_key(tmp_path):
    path = tmp_path / "trl.yaml"
    path.write_text("trainer:\n  learning_rate: 1.0e-5\n")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'trainer.learning_rate'; did you mean 'trainer.lr'"
    ):
        load_config(path)


def test_every_peer_name_is_no_sluice_key_and_every_target_is_one():
    keys = schema_keys()
    assert not keys & (set(PEER_NAMES) | set(VERL_PATHS)), "a peer name shadows a Sluice key"
    assert not set(PEER_NAMES) & set(RENAMED_KEYS)
    targets = {peer.target for peer in PEER_NAMES.values() if peer.target}
    assert targets <= keys, f"targets that are no Sluice key: {targets - keys}"
    assert set(VERL_PATHS.values()) <= set(PEER_NAMES)
    for name, peer in PEER_NAMES.items():
        assert bool(peer.target) != bool(peer.refusal), f"{name}: a target or a refusal"


def test_the_docs_table_names_every_peer_name():
    text = DOCS.read_text()
    section = text.split("## Names from TRL and verl", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in PEER_NAMES if f"`{name}`" not in section]
    assert missing == [], f"peer names docs/configuration.md does not list: {missing}"
