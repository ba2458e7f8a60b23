"""The train flow with ``trainer.backend=megatron``: roles in processes, versions published
as HF directories that the inference engine loads, and a resumed run that goes on."""

import json
from pathlib import Path

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.streams.reader import StreamReader
from sluice.tasks.run.paths import registered_model_name, run_paths
from tests.flows.conftest import tiny_run_overrides

pytestmark = pytest.mark.flows


def test_megatron_backend_trains_publishes_hf_versions_and_resumes(prefect_api, tmp_path):
    from sluice.engines.inference.engine import InferenceEngine
    from sluice.engines.inference.types import GenerationRequest, SamplingParams
    from sluice.flows.train import train

    overrides = tiny_run_overrides(
        tmp_path, **{"trainer.backend": "megatron", "trainer.total_steps": 2}
    )
    first = load_config("default", overrides)
    assert train(first, run_id="mg")["final_policy_version"] == 2

    longer = first.model_copy(deep=True)
    longer.trainer.total_steps = 3
    train(longer, run_id="mg", resume=True)

    registry = CheckpointRegistry(longer.tracking.uri, registered_model_name(longer, "mg"))
    assert [v.policy_version for v in registry.versions()] == [0, 1, 2, 3]
    trainer = StreamReader(longer.storage.url, "mg", "scored", consumer="trainer")
    assert len(trainer.acked()) == 3 * longer.trainer.prompts_per_batch

    newest = Path(registry.newest_servable().checkpoint_uri.removeprefix("file://"))
    trainer_state = Path(run_paths(longer, "mg").trainer_state(3).removeprefix("file://"))
    state = json.loads((trainer_state / "trainer_state.json").read_text())
    assert state["backend"] == "megatron"
    assert state["steps_done"] == 3
    engine = InferenceEngine(newest, max_batch_size=2, max_seq_len=32)
    out = engine.generate([GenerationRequest([3, 4, 5], SamplingParams(max_new_tokens=4, seed=0))])
    assert len(out[0].output_token_ids) >= 1


@pytest.mark.parametrize(
    ("size", "shard"),
    [("tensor_parallel", "optimizer.tp1.pt"), ("pipeline_parallel", "optimizer.pp1.pt")],
)
def test_a_two_rank_run_trains_with_a_following_rank_and_leaves_none(
    size, shard, prefect_api, tmp_path
):
    from sluice.flows.train import train

    overrides = tiny_run_overrides(
        tmp_path,
        # Two layers: one per pipeline stage (tensor parallelism splits the two heads).
        **{
            "trainer.backend": "megatron",
            f"trainer.{size}": 2,
            "trainer.total_steps": 2,
            "model.tiny.num_layers": 2,
        },
    )
    config = load_config("default", overrides)
    before = _spawned_children()
    assert train(config, run_id=size)["final_policy_version"] == 2

    registry = CheckpointRegistry(config.tracking.uri, registered_model_name(config, size))
    newest = Path(registry.newest_servable().checkpoint_uri.removeprefix("file://"))
    # Rank 1 kept its own optimizer shard beside rank 0's, in the version's trainer state;
    # the published folder holds rank 0's gathered HF weights only.
    state = Path(run_paths(config, size).trainer_state(2).removeprefix("file://"))
    assert (state / "optimizer.pt").exists() and (state / shard).exists()
    assert json.loads((state / "trainer_state.json").read_text())["steps_done"] == 2
    assert not list(newest.glob("optimizer*")) and (newest / "model.safetensors").exists()
    assert _spawned_children() - before == set()


def _spawned_children() -> set[int]:
    """Pids of live processes started by multiprocessing's spawn (as following ranks are)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if proc.name.isdigit() and b"multiprocessing.spawn" in cmdline:
            pids.add(int(proc.name))
    return pids
