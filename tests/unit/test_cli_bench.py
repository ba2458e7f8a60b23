"""`sluice bench time-to-target|staleness|mismatch|determinism` argument handling: fast, no Prefect started."""

import sys
import types

import pytest

from sluice.flows.cli import main, parse
from sluice.infra.config.run import load_config


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_study_options_parse_into_cells_and_seeds():
    args, _ = parse(
        ["bench", "staleness", "--eta", "0", "--eta", "4", "--objective", "naive", "--seeds", "2"]
    )
    assert (args.etas, args.objectives, args.seeds) == ([0, 4], ["naive"], 2)
    args, _ = parse(["bench", "mismatch", "--mode", "token_tis", "--mode", "geometric_rs"])
    assert args.modes == ["token_tis", "geometric_rs"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "mismatch", "--eta", "4"], "--eta applies to 'sluice bench staleness' only"),
        (["bench", "staleness", "--mode", "none"], "--mode applies to 'sluice bench mismatch'"),
        (["bench", "async-vs-sync", "--seeds", "2"], "--seeds applies to"),
        (["bench", "staleness", "--seeds", "0"], "--seeds must be >= 1"),
        (
            ["bench", "staleness", "--set", "staleness.max_staleness=2"],
            "sets staleness.max_staleness in every cell; choose values with --eta",
        ),
        (
            ["bench", "mismatch", "--set", "trainer.correction.mode=none"],
            "choose values with --mode",
        ),
        (
            ["bench", "mismatch", "--set", "trainer.loss.decoupled=false"],
            "only the decoupled objective applies",
        ),
        (["bench", "staleness", "--horizon", "60"], "--horizon applies to"),
        (["bench", "time-to-target", "--horizon", "0"], "--horizon must be > 0"),
        (["bench", "time-to-target", "--delta", "-0.1"], "--delta must be > 0"),
        (["bench", "time-to-target", "--variant", "async η=9"], "unknown contender"),
        (
            ["bench", "time-to-target", "--set", "trainer.time_budget_s=10"],
            "choose values with --horizon",
        ),
        # The default contenders fix η; the dynamic one sets dynamic sampling itself.
        (
            ["bench", "time-to-target", "--set", "staleness.max_staleness=2"],
            "set staleness.max_staleness themselves",
        ),
        (
            [
                "bench",
                "time-to-target",
                "--variant",
                "async η=config dynamic",
                "--set",
                "trainer.dynamic_sampling=false",
            ],
            "set trainer.dynamic_sampling themselves",
        ),
    ],
)
def test_study_options_that_cannot_apply_fail_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    assert message in one_error_line(capsys)


def test_bench_time_to_target_hands_its_options_to_the_benchmark(monkeypatch):
    calls = []
    fake = types.ModuleType("sluice.flows.bench.time_to_target")
    fake.TTT_DEFAULTS = {}
    fake.bench_time_to_target = lambda config, contenders, **options: calls.append(
        {"contenders": contenders, **options}
    )
    monkeypatch.setitem(sys.modules, "sluice.flows.bench.time_to_target", fake)
    argv = ["bench", "time-to-target", "--variant", "sync", "--variant", "async η=4"]
    assert main([*argv, "--seeds", "2", "--horizon", "90", "--delta", "0.1"]) == 0
    assert calls == [
        {"contenders": ["sync", "async η=4"], "seeds": 2, "horizon_s": 90.0, "delta": 0.1}
    ]


def test_bench_determinism_hands_config_and_overrides_to_flows_determinism(monkeypatch):
    calls = []
    fake = types.ModuleType("sluice.flows.bench.determinism")
    fake.DEFAULT_STEPS = 5
    fake.apply_check_defaults = lambda config, overrides: (
        calls.append((config, overrides)) or config
    )
    fake.determinism_check = lambda config, steps: {"matched": True}
    monkeypatch.setitem(sys.modules, "sluice.flows.bench.determinism", fake)
    assert main(["bench", "determinism", "--set", "trainer.total_steps=3"]) == 0
    ((config, overrides),) = calls
    assert config.trainer.total_steps == 3
    assert overrides == ["trainer.total_steps=3"]


def test_bench_determinism_without_its_module_says_so(monkeypatch, capsys):
    monkeypatch.setitem(
        sys.modules, "sluice.flows.bench.determinism", None
    )  # import fails as if absent
    assert main(["bench", "determinism"]) == 2
    assert "flows/bench/determinism.py" in one_error_line(capsys)


def test_study_defaults_reach_nested_keys_and_yield_to_explicit_overrides():
    from sluice.flows.bench.async_vs_sync import apply_bench_defaults
    from sluice.flows.bench.studies import MISMATCH_DEFAULTS

    overrides = ["rollout.weight_noise_std=0.2"]
    config = apply_bench_defaults(load_config("default", overrides), overrides, MISMATCH_DEFAULTS)
    assert config.rollout.weight_noise_std == 0.2
    assert config.staleness.max_staleness == MISMATCH_DEFAULTS["staleness.max_staleness"]
    assert config.trainer.total_steps == MISMATCH_DEFAULTS["trainer.total_steps"]


def test_every_seed_of_a_cell_is_its_own_named_run_from_the_same_initial_policy(tmp_path):
    from sluice.flows.bench.studies import STALENESS, pin_initial_policy, run_config, seeds_of
    from sluice.flows.bench.study_stats import staleness_cells

    base = load_config("default", [f"model.path={tmp_path}", "seed=10"])
    assert pin_initial_policy(base) is base  # a given model.path is every run's version 0
    cell = staleness_cells([8], ["naive"])[0]
    configs = [run_config(base, STALENESS, "T", cell, seed) for seed in seeds_of(base, 3)]
    assert [c.seed for c in configs] == [10, 11, 12]
    assert [c.name for c in configs] == [f"staleness-T-eta8-naive-s{s}" for s in (10, 11, 12)]
    assert all(c.staleness.max_staleness == 8 and not c.trainer.loss.decoupled for c in configs)
    assert all(c.model.path == str(tmp_path) for c in configs)


def test_time_to_target_contenders_that_keep_the_configs_eta_let_it_be_set(monkeypatch):
    calls = []
    fake = types.ModuleType("sluice.flows.bench.time_to_target")
    fake.TTT_DEFAULTS = {}
    fake.bench_time_to_target = lambda config, contenders, **options: calls.append(
        (config.staleness.max_staleness, contenders)
    )
    monkeypatch.setitem(sys.modules, "sluice.flows.bench.time_to_target", fake)
    variants = ["--variant", "async η=config", "--variant", "async η=config dynamic"]
    argv = ["bench", "time-to-target", *variants, "--set", "staleness.max_staleness=3"]
    assert main(argv) == 0
    assert calls == [(3, ["async η=config", "async η=config dynamic"])]
