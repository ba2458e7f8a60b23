"""Two seeded synchronous runs log bit-identical losses; a different seed does not."""

import os

import pytest

from sluice.flows.bench.determinism import compare_histories, determinism_check, run_sync
from sluice.infra.config import load_config
from tests.flows.conftest import tiny_run_overrides

pytestmark = [pytest.mark.flows, pytest.mark.slow]

# A random tiny policy never answers the built-in task, so every reward would be 0, every
# advantage 0 and every loss exactly 0.0 in both runs: equal, and testing nothing. A
# graded reward gives each group a spread, so the losses carry the trainer's numerics.
GRADED_REWARD = """
def digit_fraction(row, text):
    return sum(c.isdigit() for c in text) / max(1, len(text))
"""


@pytest.fixture
def graded_verifier(tmp_path, monkeypatch):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "determinism_reward.py").write_text(GRADED_REWARD)
    # Role processes inherit the environment; they import the verifier, not this process.
    path = os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    return "determinism_reward:digit_fraction"


def test_seeded_sync_runs_match_bit_for_bit_and_another_seed_differs(
    prefect_api, tmp_path, graded_verifier
):
    overrides = tiny_run_overrides(
        tmp_path,
        **{
            "reward.verifier": graded_verifier,
            "rollout.group_size": 4,
            "rollout.max_new_tokens": 24,
            "trainer.prompts_per_batch": 2,
            "trainer.ppo_minibatches": 2,  # the seeded minibatch permutation is in play
        },
    )
    config = load_config("default", overrides)

    result = determinism_check(config, steps=2)

    assert result["threads"] is not None  # pinned in the config, not left to each process
    losses = [r for r in result["rows"] if r["metric"] == "loss/policy_loss"]
    assert [r["step"] for r in losses] == [1, 2]
    assert not result["vacuous"], losses  # a real loss, not 0.0 from zero advantages
    assert all(r["a"] == r["b"] and r["identical"] for r in losses), losses
    assert result["initial_weights_identical"] and result["final_weights_identical"]
    assert result["matched"]

    # The same comparison must see a difference when only the seed changes.
    other = config.model_copy(deep=True)
    other.seed = config.seed + 1
    other.trainer.total_steps = 2
    other.threads_per_role = result["threads"]
    reseeded = run_sync(other, "determinism-other-seed")
    rows = compare_histories(result["runs"][0]["histories"], reseeded["histories"])
    reseeded_losses = [r for r in rows if r["metric"] == "loss/policy_loss"]
    assert [r["step"] for r in reseeded_losses] == [1, 2]
    assert not any(r["identical"] for r in reseeded_losses), reseeded_losses
