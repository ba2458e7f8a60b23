"""verl's modes by name: each sets η, publish_every and interruptibility as the table in
infra/config/staleness.py says, a key set explicitly still wins, and the run can say what it
resolved."""

import pytest

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import RunConfig, load_config
from sluice.infra.config.staleness import MODES, describe_mode


def knobs(config):
    return (
        config.staleness.max_staleness,
        config.trainer.publish_every,
        config.rollout.interruptible,
    )


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("on_policy", (0, 1, False)),
        ("one_step_off", (1, 1, False)),
        ("stream", (3, 4, False)),  # K = 4 local updates per sync, eta = K - 1
        ("stale", (5, 4, False)),  # ceil((1 + 0.5) * 4) - 1
        ("partial", (5, 4, True)),
    ],
)
def test_each_mode_sets_the_staleness_bound_publishing_and_interruption(mode, expected):
    assert knobs(load_config(None, [f"mode={mode}"])) == expected
    assert set(MODES) == {"on_policy", "one_step_off", "stream", "stale", "partial"}


def test_a_mode_given_with_set_overrides_the_file_and_an_explicit_set_key_wins():
    assert load_config("reasoning_gym").staleness.max_staleness == 2  # the file's own
    assert knobs(load_config("reasoning_gym", ["mode=stream"])) == (3, 4, False)
    config = load_config("reasoning_gym", ["mode=stream", "trainer.publish_every=2"])
    assert knobs(config) == (3, 2, False)
    line = describe_mode(config)
    assert line == (
        "mode stream: staleness.max_staleness=3, trainer.publish_every=2 (set explicitly; "
        "the mode says 4), rollout.interruptible=false"
    )


def test_a_mode_in_a_file_leaves_that_files_keys_alone(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("mode: partial\nstaleness:\n  max_staleness: 8\n")
    assert knobs(load_config(path)) == (8, 4, True)
    assert knobs(load_config(path, ["rollout.interruptible=false"])) == (8, 4, False)


def test_a_config_built_from_a_mapping_resolves_its_mode_and_round_trips():
    config = RunConfig.model_validate({"mode": "one_step_off", "trainer": {"lr": 1e-3}})
    assert knobs(config) == (1, 1, False) and config.trainer.lr == 1e-3
    assert RunConfig.model_validate(config.model_dump(mode="json")) == config
    assert describe_mode(load_config(None)) is None


def test_an_unknown_mode_is_one_line_naming_the_modes():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["mode=fast"])
    assert "\n" not in str(err.value) and "'on_policy', 'one_step_off'" in str(err.value)
