"""Every bad-input path of the config gives one clear line; good input round-trips."""

import subprocess
import sys

import pytest

from sluice.infra.config.overrides import ConfigError

# Shipped configs whose run starts with a supervised pass on the user's model: they load
from sluice.infra.config.run import CONFIG_DIR, RunConfig, load_config

# Shipped configs whose run starts with a supervised pass on the user's model: they load
# only with model.path given.
NEEDS_A_MODEL = {"reasoning_gym_mix"}


def test_builtin_configs_validate():
    for path in CONFIG_DIR.glob("*.yaml"):
        overrides = ["model.path=models/smollm2"] if path.stem in NEEDS_A_MODEL else []
        assert isinstance(load_config(path, overrides), RunConfig)


def test_a_shipped_supervised_pass_without_a_model_fails_in_one_line():
    for name in NEEDS_A_MODEL:
        with pytest.raises(ConfigError, match="model.supervised trains a model you give in"):
            load_config(name)
        assert load_config(name, ["model.path=models/smollm2"]).model.supervised.minutes > 0


def test_override_sets_nested_values_with_yaml_types():
    cfg = load_config(
        "default",
        [
            "staleness.max_staleness=0",
            "trainer.loss.decoupled=false",
            "rollout.server_urls=[http://a:1, http://b:2]",
            "model.path=null",
            "trainer.lr=3e-4",
        ],
    )
    assert cfg.staleness.max_staleness == 0
    assert cfg.trainer.loss.decoupled is False
    assert cfg.rollout.server_urls == ["http://a:1", "http://b:2"]
    assert cfg.model.path is None
    assert cfg.trainer.lr == pytest.approx(3e-4)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.lrr=1"], "unknown config key 'trainer.lrr'; did you mean 'trainer.lr'?"),
        (["rolout.group_size=4"], "unknown config key 'rolout'; did you mean 'rollout'?"),
        (["group_size=4"], "did you mean 'rollout.group_size'?"),
        (["rollout.eta=3"], "it was renamed to 'staleness.max_staleness'"),
        (["problem.eval_samples=2"], "it was renamed to 'evaluation.samples'"),
        (["trainer.eval_during_run=false"], "it was renamed to 'evaluation.during_run'"),
        (["model.dtype=bfloat16"], "it was renamed to 'rollout.dtype'"),
        (["trainer.backend=jax"], "invalid value for 'trainer.backend'"),
        (["rollout.pause_mode=nope"], "invalid value for 'rollout.pause_mode'"),
        (["trainer.lr=abc"], "invalid value for 'trainer.lr' = \"abc\""),
        (["staleness.max_staleness=-1"], "greater than or equal to 0"),
        (["model.tiny.num_heads=3"], "num_heads (3) must divide hidden_size (128)"),
        (["trainer.correction.mode=foo"], "invalid value for 'trainer.correction.mode'"),
        (["name=has space"], "invalid value for 'name'"),
        (["x"], "--set expects key=value, got 'x'"),
        (["=3"], "--set expects key=value"),
        (["seed.deep=1"], "'seed' is a value, not a section"),
        (["trainer.tensor_parallel=2"], "tensor_parallel=2 needs backend=megatron"),
        (
            ["trainer.pipeline_parallel=2", "trainer.data_parallel=2"],
            "pipeline_parallel=2 and data_parallel=2 need backend=megatron",
        ),
        (["trainer.dtype=bfloat16"], "dtype=bfloat16 needs backend=megatron"),
    ],
)
def test_bad_override_gives_one_clear_line(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config("default", overrides)
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


def test_bad_yaml_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  lr: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+ is not valid YAML"):
        load_config(bad)


def test_a_config_that_is_not_text_or_not_a_file_gets_one_line(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"trainer:\n  lr: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"binary.yaml: not UTF-8 text .* at byte 15"):
        load_config(binary)
    (tmp_path / "adir").mkdir()
    with pytest.raises(ConfigError, match="adir: cannot be read"):
        load_config(tmp_path / "adir")


def test_non_mapping_yaml_is_rejected(tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_missing_config_lists_builtin_names():
    with pytest.raises(ConfigError, match="not found .built-in configs: .*default"):
        load_config("no-such-config")


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann)

    walk(RunConfig)


def test_cli_fails_fast_with_one_line_before_heavy_imports():
    code = (
        "import sys; from sluice.flows.cli import main; rc = main(['train', '--set', 'trainer.lrr=1']);"
        "heavy = [m for m in ('torch', 'prefect', 'mlflow') if m in sys.modules];"
        "print(rc, heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "2 []"
    assert out.stderr.count("\n") == 1
    assert "did you mean 'trainer.lr'" in out.stderr


def test_an_old_yaml_section_gets_the_new_key_named(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("problem:\n  num_eval_prompts: 32\n")
    with pytest.raises(ConfigError, match="renamed to 'evaluation.num_prompts'"):
        load_config(old)
