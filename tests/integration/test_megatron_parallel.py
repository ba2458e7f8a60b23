"""Megatron tensor parallelism on CPU: two gloo ranks on loopback, real processes.

Each rank loads its shard of a Hugging Face policy (whole query groups, half the MLP,
half the padded vocabulary) and both must produce the HF model's per-token log-probs.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.integration


def _rank_main(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)})
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from engines.batching import pack_sequences, register_packed_attention
    from engines.megatron import model as megatron_model

    megatron_model.initialize_parallel(tensor_parallel=world, pipeline_parallel=1)
    model, hf_config = megatron_model.load_hf_policy(model_dir)
    model.eval()
    generator = torch.Generator().manual_seed(0)
    packed = pack_sequences([torch.randint(3, 40, (n,), generator=generator) for n in (9, 15, 6)])
    with torch.no_grad():
        ours = megatron_model.packed_logits(model, packed, hf_config.vocab_size)
        hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        hf.set_attn_implementation(register_packed_attention())
        theirs = hf(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            **packed.attention_kwargs(),
        ).logits[0]
    targets = packed.input_ids[0, 1:, None]
    diff = (
        (
            ours.log_softmax(-1)[:-1].gather(1, targets)
            - theirs.log_softmax(-1)[:-1].gather(1, targets)
        )
        .abs()
        .max()
    )
    local_rows = model.embedding.word_embeddings.weight.shape[0]
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {"max_abs_diff": float(diff), "local_vocab_rows": local_rows, "shape": list(ours.shape)}
        )
    )
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_tensor_parallel_2_log_probs_match_hugging_face(random_model_dir, tmp_path: Path) -> None:
    # Vocabulary 41 is odd: the two ranks hold 21 rows each of a padded 42.
    model_dir = random_model_dir(seed=5, vocab_size=41, tie_word_embeddings=False)
    mp.start_processes(
        _rank_main,
        args=(2, _free_port(), str(model_dir), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["local_vocab_rows"] == 21
        assert report["shape"][1] == 41
        assert report["max_abs_diff"] <= 1e-5


def _train_rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)})
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    from engines.loss import make_policy_loss
    from engines.megatron.trainer import MegatronPolicyTrainer
    from engines.rollout_correction import make_rollout_correction
    from tests.unit.test_megatron_trainer import SETTINGS, SHIPPED, _samples

    trainer = MegatronPolicyTrainer(
        SHIPPED,
        SETTINGS,
        make_policy_loss(),
        make_rollout_correction(mode="token_tis"),
        tensor_parallel=world,
    )
    metrics = [trainer.train_step(_samples(step)) for step in range(3)]
    weights = trainer.hf_state_dict()
    saved = trainer.save(Path(out_dir) / "v3")
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, Path(out_dir) / "rank0.pt")
    assert (saved / ("optimizer.pt" if rank == 0 else f"optimizer.tp{rank}.pt")).exists()
    torch.distributed.destroy_process_group()


def test_tensor_parallel_2_trains_like_the_torch_backend(tmp_path: Path) -> None:
    """Three PPO steps at TP=2 (the shipped policy: 4 heads, vocabulary 101 padded to
    102) against the torch backend in this process: the same metrics, weights within 1e-5."""
    from engines.inference.weights import read_weight_files
    from engines.loss import make_policy_loss
    from engines.rollout_correction import make_rollout_correction
    from engines.trainer import PolicyTrainer
    from tests.unit.test_megatron_trainer import SETTINGS, SHIPPED, _samples

    mp.start_processes(
        _train_rank_main,
        args=(2, _free_port(), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    reference = PolicyTrainer(
        SHIPPED, SETTINGS, make_policy_loss(), make_rollout_correction(mode="token_tis")
    )
    for step in range(3):
        theirs = reference.train_step(_samples(step))
        ours = result["metrics"][step]
        for key in ("loss/policy_loss", "train/grad_norm", "mismatch/kl_k3"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), (step, key)
    for name, param in reference.model.named_parameters():
        if name in result["weights"]:
            torch.testing.assert_close(result["weights"][name], param.detach(), rtol=0, atol=1e-5)
    # The published directory is the gathered model, loadable as plain HF weights.
    on_disk = read_weight_files(tmp_path / "v3")
    for name, tensor in result["weights"].items():
        assert torch.equal(on_disk[name], tensor), name
