"""The policy trainer on Megatron-core: ``trainer.backend: megatron``.

Everything algorithmic is ``engines.trainer.PolicyTrainer``'s: the π_prox pass, rollout
correction, PPO minibatches, dynamic micro-batching and the loss function. This class
replaces only what touches the model: the forward pass (a Megatron ``GPTModel`` over
the packed micro-batch), the optimizer step (Megatron's DDP, Adam, gradient clipping
and ``get_forward_backward_func``, see ``engines.megatron.optimizer``) and saving, which
writes the Hugging Face directory that the inference engine and SGLang load.

Parallel sizes: tensor parallel N runs one of these per rank, in step (see
``engines.megatron.lockstep``); pipeline parallel is not built yet.

Departure from the torch backend: Megatron's Adam applies no weight decay to biases
and norm weights (the torch backend decays every parameter); the two agree at the
default ``weight_decay=0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state

from engines.batching import PackedBatch
from engines.loss import PolicyLossFn
from engines.megatron import convert
from engines.megatron.model import initialize_parallel, load_hf_policy, packed_logits
from engines.megatron.optimizer import MegatronPolicyOptimizer
from engines.rollout_correction import RolloutCorrectionFn
from engines.trainer import (
    OPTIMIZER_FILE,
    MicroBatchLossFn,
    PolicyTrainer,
    TrainerSettings,
)


class MegatronPolicyTrainer(PolicyTrainer):
    """``PolicyTrainer`` whose policy is a Megatron ``GPTModel`` (tensor parallel optional)."""

    backend = "megatron"

    def __init__(
        self,
        model_dir: str | Path,
        settings: TrainerSettings,
        loss_fn: PolicyLossFn,
        correction_fn: RolloutCorrectionFn | None,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        decoupled: bool = True,
        tensor_parallel: int = 1,
    ):
        """As ``PolicyTrainer``; with ``tensor_parallel`` > 1, one process per rank
        constructs one and every rank calls each method in step, with the same samples."""
        initialize_parallel(tensor_parallel, 1)
        self.megatron, self.hf_config = load_hf_policy(model_dir, params_dtype=dtype, device=device)
        self.megatron.train()
        self.policy_optimizer = MegatronPolicyOptimizer(
            self.megatron,
            lr=settings.lr,
            adam_betas=settings.adam_betas,
            adam_eps=settings.adam_eps,
            weight_decay=settings.weight_decay,
            grad_clip=settings.grad_clip,
            vocab_size=int(self.hf_config.vocab_size),
        )
        super().__init__(
            model_dir,
            settings,
            loss_fn,
            correction_fn,
            device=device,
            dtype=dtype,
            decoupled=decoupled,
        )

    # PolicyTrainer's constructor builds a Hugging Face model and a torch optimizer; here
    # the HF model is only the skeleton that ``save`` fills, and the optimizer is
    # Megatron's.
    def _make_optimizer(self) -> Any:
        return self.policy_optimizer.optimizer

    def _optimizer_file(self) -> str:
        # Each tensor-parallel rank holds the Adam state of its own shard.
        rank = parallel_state.get_tensor_model_parallel_rank()
        return OPTIMIZER_FILE if rank == 0 else f"optimizer.tp{rank}.pt"

    def _load_optimizer_state(self, path: Path) -> None:
        state = torch.load(path.parent / self._optimizer_file(), weights_only=False)
        self.policy_optimizer.optimizer.load_state_dict(state)

    def _logits(self, packed: PackedBatch) -> torch.Tensor:
        return packed_logits(self.megatron, packed, int(self.hf_config.vocab_size))

    def _set_training(self, training: bool) -> None:
        self.megatron.train(training)

    def _optimizer_step(
        self, micro_batches: list[PackedBatch], token_counts: list[int], loss_of: MicroBatchLossFn
    ) -> float:
        # Megatron's per-token mode wants each micro-batch's token *sum* and divides by the
        # total count itself; the shared loss is normalised by that total, so scale back.
        total = sum(token_counts)
        _, grad_norm, _ = self.policy_optimizer.step(
            micro_batches,
            lambda index, logits: (loss_of(index, logits) * total, token_counts[index], {}),
        )
        return grad_norm

    def _barrier(self) -> None:
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.barrier(group=parallel_state.get_tensor_model_parallel_group())

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights in Hugging Face names and layout (collective: every
        tensor-parallel rank must call it; each gets the whole model)."""
        weights = {
            name: tensor.detach()
            for name, tensor in self.megatron.state_dict().items()
            if not name.endswith("._extra_state")
        }
        size = parallel_state.get_tensor_model_parallel_world_size()
        if size > 1:
            shards: list[Any] = [None] * size
            torch.distributed.all_gather_object(
                shards, weights, group=parallel_state.get_tensor_model_parallel_group()
            )
            weights = convert.tensor_parallel_merge(shards, self.hf_config)
        return convert.megatron_to_hf(weights, self.hf_config)

    def _save_weights_and_optimizer(self, out: Path, include_optimizer: bool) -> bool:
        """Every rank writes its optimizer shard; tensor-parallel rank 0 the gathered HF
        weights, and it returns only once every shard is on disk (its caller uploads the
        directory). Collective: every rank must call ``save``."""
        weights = self.hf_state_dict()
        if include_optimizer:
            torch.save(self.policy_optimizer.optimizer.state_dict(), out / self._optimizer_file())
        self._barrier()
        if parallel_state.get_tensor_model_parallel_rank() != 0:
            return False
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if self.hf_config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"Megatron -> HF left {missing} missing, {unexpected} unexpected")
        self.model.save_pretrained(out, safe_serialization=True)
        return True
