"""`device` and `rollout.dtype` reach every engine that generates, not only the rollout's server."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engines.policy.model import resolve_device
from sluice.infra.config.run import load_config
from sluice.tasks.evaluate.role import evaluate_model_dir

SHIPPED = (
    Path(__file__).resolve().parents[2]
    / "engines"
    / "policy"
    / "policies"
    / "longtail_sum-llama-0.9m"
)


def small_eval(*overrides: str):
    return load_config(
        "default",
        [
            "evaluation.num_prompts=2",
            "evaluation.greedy=false",
            "rollout.max_new_tokens=8",
            *overrides,
        ],
    )


def test_auto_device_is_cpu_without_a_gpu_and_explicit_devices_pass_through():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("cuda:1") == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_evaluation_honours_the_configured_device():
    # Asked for CUDA on a machine without it, the evaluator must try (and fail), not
    # quietly evaluate on the CPU as it once did.
    with pytest.raises(ValueError, match="CUDA is not available"):
        evaluate_model_dir(small_eval("device=cuda"), SHIPPED, 0)


def test_evaluation_runs_in_the_configured_dtype():
    float32 = evaluate_model_dir(small_eval("device=cpu"), SHIPPED, 0)
    bfloat16 = evaluate_model_dir(small_eval("device=cpu", "rollout.dtype=bfloat16"), SHIPPED, 0)
    assert set(float32) == set(bfloat16)
    assert 0.0 <= bfloat16["eval/reward"] <= 1.0
