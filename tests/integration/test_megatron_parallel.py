"""Megatron split over gloo ranks on loopback, real processes: tensor, pipeline and
data parallel.

Each rank loads its part of a Hugging Face policy (whole query groups and half the
padded vocabulary, or half the layers, or all of it) and every layout must produce the
HF model's per-token log-probs and train like the torch backend. Two ranks split the
suite's small models every way; three split SmolLM2-135M-Instruct's 3 key/value heads
(tensor parallel 3), where it is installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.integration


def _rank_main(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)})
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from sluice.engines.megatron import model as megatron_model
    from sluice.engines.rl.batching import pack_sequences, register_packed_attention

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


def _train_rank_main(
    rank: int,
    world: int,
    port: int,
    out_dir: str,
    tensor_parallel: int,
    pipeline_parallel: int,
    data_parallel: int,
    distributed_optimizer: bool,
) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)})
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    from sluice.engines.megatron.trainer import MegatronPolicyTrainer
    from sluice.engines.rl.loss import make_policy_loss
    from sluice.engines.rl.rollout_correction import make_rollout_correction
    from tests.unit.test_megatron_trainer import SETTINGS, SHIPPED, _samples

    def make(model_dir: Path) -> MegatronPolicyTrainer:
        return MegatronPolicyTrainer(
            model_dir,
            SETTINGS,
            make_policy_loss(),
            make_rollout_correction(mode="token_tis"),
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            data_parallel=data_parallel,
            distributed_optimizer=distributed_optimizer,
        )

    trainer = make(SHIPPED)
    logprobs = trainer.response_logprobs(_samples(0))
    metrics = [trainer.train_step(_samples(step)) for step in range(3)]
    weights = trainer.hf_state_dict()
    saved = trainer.save(Path(out_dir) / "v3")
    torch.distributed.barrier()  # rank 0 writes the HF files after the others return
    # A trainer resumed from the version takes the next step as the one that wrote it.
    resumed = make(saved)
    resumed_loss = resumed.train_step(_samples(3))["loss/policy_loss"]
    continued_loss = trainer.train_step(_samples(3))["loss/policy_loss"]
    resumed_gap = max(
        float((a - b).abs().max())
        for a, b in zip(
            resumed.hf_state_dict().values(), trainer.hf_state_dict().values(), strict=True
        )
    )
    from megatron.core import parallel_state

    layout = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(),
        len(trainer.megatron.decoder.layers),
        type(trainer.policy_optimizer.optimizer.chained_optimizers[0]).__name__,
    )
    torch.save(
        {
            "logprobs": logprobs,
            "metrics": metrics,
            "weights": weights,
            "files": os.listdir(saved),
            "layout": layout,
            "resumed": (resumed_loss, continued_loss, resumed_gap),
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    torch.distributed.destroy_process_group()


# (tensor, pipeline, data) sizes of a world of two, and the distributed optimizer.
LAYOUTS = {
    "tp2": (2, 1, 1, False),
    "pp2": (1, 2, 1, False),
    "dp2": (1, 1, 2, False),
    "dp2-zero1": (1, 1, 2, True),
}
# What each rank then holds: (tensor, pipeline, data) sizes, its share of the 4 layers
# and its optimizer.
HELD = {
    "tp2": (2, 1, 1, 4, "FP32Optimizer"),
    "pp2": (1, 2, 1, 2, "FP32Optimizer"),
    "dp2": (1, 1, 2, 4, "FP32Optimizer"),
    "dp2-zero1": (1, 1, 2, 4, "DistributedOptimizer"),
}
OPTIMIZER_FILES = {
    "tp2": {"optimizer.pt", "optimizer.tp1.pt"},
    "pp2": {"optimizer.pt", "optimizer.pp1.pt"},
    "dp2": {"optimizer.pt"},  # the replicas' Adam states are the same: written once
    "dp2-zero1": {"optimizer.pt", "optimizer.sharded.pt"},  # both halves, gathered
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_rank_layouts_train_like_the_torch_backend(layout: str, tmp_path: Path) -> None:
    """Per-token log-probs, then three PPO steps (two minibatches, several micro-batches
    each, token TIS) on the shipped policy (4 layers, 4 heads, tied embeddings,
    vocabulary 101), split two ways, against the torch backend in this process: every
    rank reads the same log-probs and metrics as torch and holds the same weights; the
    published directory is the gathered model.

    Tolerances: log-probs within 1e-5 absolute or 2e-6 relative (split matmuls sum the
    same products in another order; the worst seen is 1.1e-5 on a log-prob of -7.6),
    metrics within 1e-4 relative, weights within 1e-5 absolute."""
    from sluice.engines.inference.weights import read_weight_files
    from sluice.engines.rl.loss import make_policy_loss
    from sluice.engines.rl.rollout_correction import make_rollout_correction
    from sluice.engines.rl.trainer import PolicyTrainer
    from tests.unit.test_megatron_trainer import SETTINGS, SHIPPED, _samples

    mp.start_processes(
        _train_rank_main,
        args=(2, _free_port(), str(tmp_path), *LAYOUTS[layout]),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    # The Megatron trainer gives each pipeline of each replica at least as many
    # micro-batches as it has stages; the reference packs the same way.
    _, pipeline_parallel, data_parallel, _ = LAYOUTS[layout]
    settings = dataclasses.replace(SETTINGS, min_micro_batches=pipeline_parallel * data_parallel)
    reference = PolicyTrainer(
        SHIPPED, settings, make_policy_loss(), make_rollout_correction(mode="token_tis")
    )
    expected_logprobs = reference.response_logprobs(_samples(0))
    expected_metrics = [reference.train_step(_samples(step)) for step in range(3)]
    expected_weights = dict(reference.model.named_parameters())
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["layout"] == HELD[layout]
        resumed_loss, continued_loss, resumed_gap = result["resumed"]
        assert resumed_loss == pytest.approx(continued_loss, rel=1e-6)
        assert resumed_gap <= 1e-6
        for ours, theirs in zip(result["logprobs"], expected_logprobs, strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=1e-5)
        for step, (ours, theirs) in enumerate(
            zip(result["metrics"], expected_metrics, strict=True)
        ):
            assert ours["train/micro_batches"] == theirs["train/micro_batches"] > 2
            for key in ("loss/policy_loss", "train/grad_norm", "mismatch/kl_k3", "policy/entropy"):
                expected = pytest.approx(theirs[key], rel=1e-4, abs=1e-7)
                assert ours[key] == expected, f"rank {rank}, step {step}: {key}"
        assert set(result["weights"]) == set(expected_weights) - {"lm_head.weight"}
        for name, tensor in result["weights"].items():
            torch.testing.assert_close(tensor, expected_weights[name].detach(), rtol=0, atol=1e-5)
        written = {name for name in result["files"] if name.startswith("optimizer")}
        assert written == OPTIMIZER_FILES[layout]
    on_disk = read_weight_files(tmp_path / "v3")
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for name, tensor in rank0["weights"].items():
        assert torch.equal(on_disk[name], tensor), name


def _smollm2_rank_main(
    rank: int, world: int, port: int, model_dir: str, samples: list, out_dir: str
) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)})
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    from sluice.engines.megatron.trainer import MegatronPolicyTrainer
    from sluice.engines.rl.loss import make_policy_loss
    from tests.unit.test_megatron_smollm2 import STEP_SETTINGS

    trainer = MegatronPolicyTrainer(
        model_dir, STEP_SETTINGS, make_policy_loss(), None, tensor_parallel=world
    )
    attention = trainer.megatron.decoder.layers[0].self_attention
    held = {
        "vocab_rows": trainer.megatron.embedding.word_embeddings.weight.shape[0],
        "qkv_rows": attention.linear_qkv.weight.shape[0],
        "fc1_rows": trainer.megatron.decoder.layers[0].mlp.linear_fc1.weight.shape[0],
    }
    logprobs = trainer.response_logprobs(samples)
    metrics = trainer.train_step(samples)
    after = trainer.response_logprobs(samples)
    torch.save(
        {"held": held, "logprobs": logprobs, "metrics": metrics, "after": after},
        Path(out_dir) / f"rank{rank}.pt",
    )
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_3_on_smollm2_matches_the_torch_backend(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """SmolLM2-135M-Instruct (9 query heads over 3 key/value heads, tied 49,152-token
    embedding) in three gloo ranks, one torch thread each: every rank holds one query
    group of three heads, a third of the MLP and 16,384 vocabulary rows (49,152 divides
    by 3, so there is no padding). On three chat-templated prompts with hand-written
    answers (tests/unit/test_megatron_smollm2.py) its log-probs, one optimizer step and
    the log-probs after it match the torch backend in this process.

    Tolerances: log-probs within 5e-5 (9.5e-6 measured: each rank's attention output
    and MLP projections are partial sums that the all-reduce adds in another order than
    one matmul does, over 30 layers); the loss, a token mean of ±ratio whose error the
    log-probs' bounds, within 1e-5 (8.7e-7); the gradient norm within 1e-4 relative
    (1.1e-5); the log-probs after the step, which it moves by up to 5 nats, within 1e-4
    (1.1e-5)."""
    from sluice.engines.rl.loss import make_policy_loss
    from tests.unit.test_megatron_smollm2 import STEP_SETTINGS, chat_samples, on_policy
    from tests.unit.test_model_import import imported_smollm2

    model_dir = imported_smollm2(tmp_path_factory).path
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from sluice.engines.rl.trainer import PolicyTrainer

        reference = PolicyTrainer(model_dir, STEP_SETTINGS, make_policy_loss(), None)
        samples = chat_samples(model_dir)
        expected_logprobs = reference.response_logprobs(samples)
        samples = on_policy(samples, expected_logprobs)
        mp.start_processes(
            _smollm2_rank_main,
            args=(3, _free_port(), str(model_dir), samples, str(tmp_path)),
            nprocs=3,
            join=True,
            start_method="spawn",
        )
        expected_metrics = reference.train_step(samples)
        expected_after = reference.response_logprobs(samples)
    finally:
        torch.set_num_threads(previous_threads)
    for rank in range(3):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        # One query group: 3 query heads, its key and its value head, 64 wide each.
        assert result["held"] == {"vocab_rows": 16_384, "qkv_rows": 5 * 64, "fc1_rows": 1024}
        for ours, theirs in zip(result["logprobs"], expected_logprobs, strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=5e-5)
        ours, theirs = result["metrics"], expected_metrics
        assert ours["loss/policy_loss"] == pytest.approx(theirs["loss/policy_loss"], abs=1e-5)
        assert ours["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-4)
        for ours, theirs in zip(result["after"], expected_after, strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
