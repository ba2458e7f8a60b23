"""The mismatch watchdog: each signal fires on its limit and on a lasting climb over its
own history, one noisy step does not, and the trainer honours a refusal before the
weights change."""

import math

import numpy as np
import pytest
import torch

from sluice.engines.rl.watchdog import SIGNALS, MismatchWatchdog, blocking, signal_rule
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import load_config
from sluice.tasks.train.watchdog import StepWatch, build_watchdog, stop_line
from tests.unit.test_trainer import make_trainer, random_samples


def steady(watchdog, metric, value, steps):
    for _ in range(steps):
        watchdog.record({metric: value})


def kl_step(watchdog, value, n):
    """Judge step `n` with k3 KL at `value`, then record it as the train role does."""
    fired = watchdog.judge({"mismatch/kl_k3": value}, step=n)
    watchdog.record({"mismatch/kl_k3": value}, fired=[f.signal for f in fired])
    return fired


@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_each_signal_fires_past_its_limit(name):
    metric, inverted = SIGNALS[name]
    # ESS's limit is its lowest allowed value; every other signal's its highest.
    watchdog = MismatchWatchdog([signal_rule(name, limit=0.4, action="stop")])
    fine, bad = (0.5, 0.3) if inverted else (0.3, 0.5)
    assert watchdog.judge({metric: fine}, step=1) == []
    (firing,) = watchdog.judge({metric: bad}, step=1)
    assert (firing.signal, firing.action, firing.value) == (name, "stop", bad)
    assert ("below" if inverted else "above") in firing.reason and "0.4" in firing.reason


def test_a_limit_over_several_steps_lets_one_outlier_pass_and_catches_a_mismatch_from_the_start():
    rule = signal_rule("kl_k3", limit=0.2, limit_steps=3)
    watchdog = MismatchWatchdog([rule])

    # A clean run's outlier (one step at 0.89 among 0.01s) stays quiet.
    assert [kl_step(watchdog, v, n) for n, v in enumerate([0.01, 0.89, 0.01, 0.01], 1)] == [[]] * 4
    # Broken from the start: quiet for two steps, then every step fires, though each
    # firing keeps its step out of the history (the limit reads the steps as they were).
    watchdog = MismatchWatchdog([rule])
    fired = [kl_step(watchdog, 2.0, n) for n in range(1, 6)]
    assert [len(f) for f in fired] == [0, 0, 1, 1, 1]
    assert "for 3 steps in a row" in fired[2][0].reason
    assert len(watchdog.history["kl_k3"]) == 2


def test_the_shipped_kl_limit_needs_three_steps_in_a_row():
    (rule,) = [r for r in build_watchdog(load_config()).rules.values() if r.name == "kl_k3"]
    assert (rule.limit, rule.limit_steps) == (0.2, 3)
    with pytest.raises(ValueError, match="limit_steps"):
        signal_rule("kl_k3", limit=0.2, limit_steps=0)


def test_a_lasting_climb_fires_on_its_third_step_and_two_outliers_do_not():
    rule = signal_rule("kl_k3", spike=8.0, floor=1e-3)
    watchdog = MismatchWatchdog([rule], recent=5, window=30, min_history=10)

    steady(watchdog, "mismatch/kl_k3", 0.01, 30)
    # Two steps at 30x the median (a 5-step mean would be 12.6x): the median of the last
    # five is still 0.01, so neither fires.
    outliers = [0.3, 0.01, 0.3, 0.01, 0.01, 0.01]
    assert [kl_step(watchdog, v, n) for n, v in enumerate(outliers, 31)] == [[]] * 6
    # A climb to 0.1 that lasts: quiet on its first two steps, fired on the third, when
    # three of the last five are 10x the median of 0.01.
    fired = [kl_step(watchdog, 0.1, n) for n in range(37, 40)]
    assert [len(f) for f in fired] == [0, 0, 1]
    assert "10.0x" in fired[2][0].reason and "median 0.01" in fired[2][0].reason


def test_a_climb_below_the_floor_or_before_enough_history_stays_quiet():
    rule = signal_rule("grad_norm", spike=10.0, floor=1.0)
    watchdog = MismatchWatchdog([rule], recent=1, window=30, min_history=10)
    steady(watchdog, "train/grad_norm", 0.01, 9)
    assert watchdog.judge({"train/grad_norm": 5.0}, step=10) == []  # 9 < min_history
    steady(watchdog, "train/grad_norm", 0.01, 1)
    assert watchdog.judge({"train/grad_norm": 0.5}, step=11) == []  # 50x, under the floor
    assert len(watchdog.judge({"train/grad_norm": 5.0}, step=11)) == 1


def test_ess_is_judged_by_how_far_it_falls():
    watchdog = MismatchWatchdog([signal_rule("ess", spike=6.0, floor=0.3)], recent=1, min_history=5)
    steady(watchdog, "is/ess_sequence", 0.95, 10)  # 1 - ESS = 0.05
    assert watchdog.judge({"is/ess_sequence": 0.75}, step=11) == []  # 0.25: 5x, under 0.3
    (firing,) = watchdog.judge({"is/ess_sequence": 0.6}, step=11)  # 0.4: 8x and over 0.3
    assert firing.value == 0.6 and "1 - is/ess_sequence" in firing.reason


def test_a_fired_step_stays_out_of_the_history_so_a_climb_is_not_absorbed():
    watchdog = MismatchWatchdog(
        [signal_rule("kl_k3", spike=5.0)], recent=1, window=10, min_history=5
    )
    steady(watchdog, "mismatch/kl_k3", 0.01, 10)
    for step in range(11, 41):  # thirty steps at 10x: every one still fires
        assert kl_step(watchdog, 0.1, step), step


def test_healthy_noise_never_fires_with_the_default_rules():
    # Log-normal noise as wide as the healthiest-looking runs show (single steps up to
    # ~10x their median), 200 steps per signal, ten seeds.
    watchdog_config = load_config(None).trainer.watchdog
    for seed in range(10):
        rng = np.random.default_rng(seed)
        config = load_config(None)
        watchdog = build_watchdog(config)
        assert watchdog is not None and watchdog_config.enabled
        for step in range(1, 201):
            metrics = {
                "mismatch/kl_k3": 0.01 * math.exp(rng.normal(0, 0.8)),
                "mismatch/log_ppl_abs_diff": 0.03 * math.exp(rng.normal(0, 0.5)),
                "train/grad_norm": 1.5 * math.exp(rng.normal(0, 0.6)),
                "is/ess_sequence": 1 - 0.2 * math.exp(rng.normal(0, 0.5)) / 1.2,
                "is/masked_fraction": 0.0,
            }
            assert watchdog.judge(metrics, step) == [], (seed, step, metrics)
            watchdog.record(metrics)


def test_a_stop_outranks_a_skip_and_a_warning_decides_nothing():
    rules = [
        signal_rule("kl_k3", limit=0.1, action="warn"),
        signal_rule("log_ppl_gap", limit=0.1, action="skip"),
        signal_rule("masked_fraction", limit=0.1, action="stop"),
    ]
    watchdog = MismatchWatchdog(rules)
    bad = {"mismatch/kl_k3": 1.0, "mismatch/log_ppl_abs_diff": 1.0, "is/masked_fraction": 1.0}
    assert blocking(watchdog.judge(bad, 3)).signal == "masked_fraction"
    assert blocking(watchdog.judge({**bad, "is/masked_fraction": 0.0}, 3)).action == "skip"
    assert blocking(watchdog.judge({"mismatch/kl_k3": 1.0}, 3)) is None


def weights(trainer):
    return torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])


def test_a_refusal_after_the_proximal_pass_leaves_the_weights_unchanged(tiny_dir):
    trainer = make_trainer(tiny_dir, ppo_minibatches=2)
    samples = random_samples(trainer)
    before = weights(trainer)
    seen = []
    metrics = trainer.train_step(samples, guard=lambda m: seen.append(dict(m)) or False)
    assert torch.equal(weights(trainer), before)
    assert metrics["train/applied_minibatches"] == 0 and trainer.steps_done == 0
    # It was asked once, with the mismatch signals, before any gradient.
    assert len(seen) == 1 and "mismatch/kl_k3" in seen[0] and "train/grad_norm" not in seen[0]


def test_a_refused_gradient_step_leaves_out_the_rest_of_the_batch(tiny_dir):
    trainer = make_trainer(tiny_dir, ppo_minibatches=2)
    samples = random_samples(trainer)
    norms = []

    def second_norm_refused(signals):
        if "train/grad_norm" in signals:
            norms.append(signals["train/grad_norm"])
        return len(norms) < 2

    metrics = trainer.train_step(samples, guard=second_norm_refused)
    assert len(norms) == 2 and metrics["train/applied_minibatches"] == 1


def test_a_guard_that_allows_everything_changes_nothing(tiny_dir):
    results = []
    for guard in (None, lambda m: True):
        torch.manual_seed(0)
        trainer = make_trainer(tiny_dir, ppo_minibatches=2)
        trainer.train_step(random_samples(trainer), guard=guard)
        results.append(weights(trainer))
    assert torch.equal(*results)


def config_with(*overrides):
    return load_config(None, ["model.shipped_policy=true", *overrides])


def test_the_train_role_watch_counts_tags_and_names_the_last_good_version():
    watch = StepWatch(
        config_with("trainer.watchdog.kl_k3.limit=0.05", "trainer.watchdog.kl_k3.action=skip"),
        mlflow_run_id="unused",
    )
    guard = watch.guard(step=7)
    assert guard({"mismatch/kl_k3": 0.2, "is/ess_sequence": 0.9}) is False
    firings, verdict = watch.settle({"train/applied_minibatches": 0.0}, step=7)
    assert [f.signal for f in firings] == ["kl_k3"] and verdict.action == "skip"
    assert watch.step_metrics(firings) == {"watchdog/kl_k3": 1.0}
    assert watch.take_tags() == {"watchdog.kl_k3": "step 7 (skip)"} and watch.take_tags() == {}
    assert watch.status()["watchdog_by_signal"] == {"kl_k3": 1}
    line = stop_line(verdict, last_good=6)
    assert "kl_k3 fired at step 7" in line and "last good version is 6" in line


def test_a_split_trainer_is_judged_after_its_step():
    watch = StepWatch(
        config_with(
            "trainer.backend=megatron",
            "trainer.tensor_parallel=2",
            "trainer.watchdog.grad_norm.limit=3",
            "trainer.watchdog.action=stop",
        ),
        mlflow_run_id="unused",
    )
    assert watch.guard(step=1) is None
    _, verdict = watch.settle({"train/grad_norm": 1.0, "train/grad_norm_max": 4.0}, step=1)
    assert verdict.signal == "grad_norm" and verdict.action == "stop"


def test_skip_with_the_megatron_backend_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="skip .* needs trainer.backend=torch"):
        config_with("trainer.backend=megatron", "trainer.watchdog.action=skip")
    # warn and stop need no hook inside the optimizer step
    config_with("trainer.backend=megatron", "trainer.watchdog.action=stop")
