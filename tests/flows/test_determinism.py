"""Two seeded synchronous runs log bit-identical losses; a different seed does not."""

import pytest

from sluice.flows.bench.determinism import compare_histories, determinism_check, run_sync
from sluice.infra.config.run import load_config
from tests.flows.conftest import tiny_run_overrides

pytestmark = [pytest.mark.flows, pytest.mark.slow]


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
