"""The reproduction check: bands load or fail with one clear line, out-of-band values are flagged."""

import ast
import json
from pathlib import Path

import pytest

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import CONFIG_DIR, load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    import sluice.flows.reproduce

    monkeypatch.setattr(sluice.flows.reproduce, "CONFIG_DIR", tmp_path)
    return tmp_path


def write_bands(directory: Path, bands: dict) -> None:
    (directory / "pinned.reference.json").write_text(json.dumps({"bands": bands}))


def summary_keys() -> set[str]:
    """Result keys that tasks/run/report.py:summarise writes (`result["key"]` or `{"key": ...}`)."""
    tree = ast.parse((REPO / "tasks" / "run" / "report.py").read_text())
    [summarise] = [
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "summarise"
    ]
    keys = set()
    for node in ast.walk(summarise):
        if isinstance(node, ast.Dict):
            keys |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
        stored = isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
        if stored and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    return keys


def test_a_well_formed_band_file_loads(config_dir):
    from sluice.flows.reproduce import load_reference

    write_bands(config_dir, {"held_out_reward_final": [0.2, 0.6], "policy_versions": [21, 21]})
    assert load_reference("pinned") == {
        "held_out_reward_final": [0.2, 0.6],
        "policy_versions": [21, 21],
    }


@pytest.mark.parametrize(
    "band", [[0.6, 0.2], [0.1], [0.1, 0.2, 0.3], 0.5, "0.1-0.2", ["a", "b"], [True, 1]]
)
def test_a_bad_band_is_one_config_error_naming_the_metric(config_dir, band):
    from sluice.flows.reproduce import load_reference

    write_bands(config_dir, {"held_out_reward_start": [0.0, 1.0], "held_out_reward_final": band})
    with pytest.raises(
        ConfigError, match=r"band for 'held_out_reward_final' must be \[low, high\]"
    ):
        load_reference("pinned")


def test_a_band_file_without_bands_or_not_json_is_one_config_error(config_dir):
    from sluice.flows.reproduce import load_reference

    (config_dir / "pinned.reference.json").write_text('{"measured": {}}')
    with pytest.raises(ConfigError, match='needs a non-empty "bands" mapping'):
        load_reference("pinned")
    (config_dir / "pinned.reference.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_reference("pinned")


def test_a_missing_band_file_is_a_config_error_naming_the_path(config_dir):
    from sluice.flows.reproduce import load_reference

    with pytest.raises(ConfigError, match="no reference band for 'absent'"):
        load_reference("absent")


def test_compare_flags_values_outside_or_missing_and_keeps_edges_inside():
    from sluice.flows.reproduce import compare

    bands = {"a": [0.2, 0.4], "b": [0.2, 0.4], "c": [0.2, 0.4], "d": [0.2, 0.4]}
    result = {"a": 0.3, "b": 0.41, "c": 0.4}  # d never reported
    verdicts = {key: ok for key, _value, _band, ok in compare(result, bands)}
    assert verdicts == {"a": True, "b": False, "c": True, "d": False}


def test_shipped_reproduce_config_validates_and_is_small():
    config = load_config("reproduce")
    assert config.name == "reproduce"
    assert config.device == "cpu"  # the band was measured on CPU
    assert config.trainer.total_steps < load_config("default").trainer.total_steps


def test_shipped_band_file_loads_and_covers_what_was_measured():
    from sluice.flows.reproduce import compare, load_reference

    bands = load_reference("reproduce")
    assert set(bands) <= summary_keys(), "a band names a metric the run summary never reports"
    assert {"held_out_reward_start", "held_out_reward_final"} <= set(bands)
    reference = json.loads((CONFIG_DIR / "reproduce.reference.json").read_text())
    for run in reference["measured"]["runs"]:
        assert all(ok for *_, ok in compare(run, bands)), run
