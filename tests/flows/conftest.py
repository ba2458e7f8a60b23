"""One Prefect test harness per session: starting its API costs ~10 s."""

import os

import pytest

from tests.conftest import local_run_settings


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


# A random tiny policy never answers the built-in task, so every reward would be 0, every
# advantage 0 and every loss exactly 0.0 in both runs: equal, and testing nothing. A
# graded reward gives each group a spread, so the losses carry the trainer's numerics.
GRADED_REWARD = """
def digit_fraction(row, text):
    return sum(c.isdigit() for c in text) / max(1, len(text))
"""


@pytest.fixture
def graded_verifier(tmp_path, monkeypatch):
    """A verifier that scores the share of digits in a response (runs compared bit for
    bit need a reward with a spread): its `module:function` name."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "determinism_reward.py").write_text(GRADED_REWARD)
    # Role processes inherit the environment; they import the verifier, not this process.
    path = os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    return "determinism_reward:digit_fraction"


def tiny_run_overrides(tmp_path, **extra):
    """A run small enough for a 2-core CI box: random tiny model, a few steps. Every file
    of it under `tmp_path` (``local_run_settings``); None leaves out where the run's
    files go, for a caller that places them itself."""
    base = {
        "name": "t",
        **(local_run_settings(tmp_path) if tmp_path is not None else {}),
        "model.warm_start": "false",
        "model.tiny.hidden_size": "32",
        "model.tiny.num_layers": "1",
        "model.tiny.num_heads": "2",
        "model.tiny.intermediate_size": "64",
        "rollout.group_size": "2",
        "rollout.max_new_tokens": "12",
        "rollout.max_batch_size": "8",
        "rollout.poll_interval_s": "0.2",
        "trainer.prompts_per_batch": "2",
        "trainer.total_steps": "3",
        "evaluation.every": "0",
        "evaluation.num_prompts": "4",
        "staleness.max_staleness": "1",
        # A random tiny model scores 0 on every prompt: dropping zero-variance groups
        # would leave the trainer nothing to step on, and these tests check the step.
        "trainer.advantage.drop_zero_variance_groups": "false",
    }
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def flow_run_artifacts(flow_run_id):
    """The Prefect artifacts one flow run created (read from the harness's API)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
                )
            )

    return asyncio.run(read())


def flow_run_name_of(flow_run_id):
    """The name Prefect's API holds for one flow run."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).name
