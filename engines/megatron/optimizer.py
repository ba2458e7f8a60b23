"""Megatron's data-parallel wrapper, optimizer and forward-backward schedule for a policy.

``MegatronPolicyOptimizer.step`` runs one optimizer step over a minibatch's packed
micro-batches through ``get_forward_backward_func`` (the schedule that also drives
pipeline parallelism), with any Sluice loss that follows the
``sluice.engines.rl.loss_inputs.PolicyLoss`` contract.

How the loss denominator maps: Sluice divides every micro-batch's token sum by the
minibatch's valid-token count, so gradient accumulation equals the whole-minibatch
gradient. Megatron's per-token mode (``calculate_per_token_loss``) asks each
micro-batch for its token *sum* and its token count, and divides the accumulated
gradients by the total count across micro-batches and data-parallel ranks once, in
``finalize_model_grads``. The loss is therefore called with ``num_global_tokens=1``
(its numerator) and Megatron supplies the denominator: the same gradient, and with
data parallelism the count spans every rank's micro-batches.

Mixed precision: with a bf16 model, Megatron's optimizer keeps fp32 main weights and
Adam state and copies the updated weights back to the model in bf16. The distributed
optimizer (``use_distributed_optimizer``, ZeRO-1) shards those fp32 weights and Adam
state across data-parallel replicas; ``save`` and ``load`` gather and scatter them.
Both run on a CPU under gloo as on a GPU (see ``sluice.engines.megatron.cpu_shim``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from sluice.engines.megatron import cpu_shim
from sluice.engines.megatron.model import packed_logits
from sluice.engines.rl.batching import PackedBatch

MicroBatchLoss = Callable[[int, torch.Tensor], tuple[torch.Tensor, int, dict[str, torch.Tensor]]]
"""``(micro-batch index, logits [T, vocab]) -> (token-sum loss, tokens counted, metrics)``."""


class MegatronPolicyOptimizer:
    """A ``GPTModel`` wrapped in Megatron's DDP, with Megatron's Adam and gradient clipping."""

    def __init__(
        self,
        model: GPTModel,
        *,
        lr: float,
        adam_betas: tuple[float, float],
        adam_eps: float,
        weight_decay: float,
        grad_clip: float,
        vocab_size: int | None = None,
        use_distributed_optimizer: bool = False,
    ) -> None:
        """``vocab_size``: the policy's real vocabulary (logits past it are padding)."""
        self.vocab_size = vocab_size
        self.distributed = distributed = use_distributed_optimizer
        model.config.calculate_per_token_loss = True
        model.config.finalize_model_grads_func = finalize_model_grads
        with cpu_shim.cpu_only():
            self.model = DistributedDataParallel(
                model.config,
                DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, use_distributed_optimizer=distributed
                ),
                model,
            )
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=lr,
                    adam_beta1=adam_betas[0],
                    adam_beta2=adam_betas[1],
                    adam_eps=adam_eps,
                    weight_decay=weight_decay,
                    clip_grad=grad_clip,
                    use_distributed_optimizer=distributed,
                    params_dtype=model.config.params_dtype,
                    bf16=model.config.bf16,
                ),
                [self.model],
            )

    def save(self, path: Path) -> None:
        """Write the optimizer state to ``path`` (the distributed optimizer's sharded
        weights and Adam state, gathered, beside it). Collective over data-parallel
        replicas; the first writes."""
        state = self.optimizer.state_dict()
        if self.distributed:
            with cpu_shim.cpu_only():
                self.optimizer.save_parameter_state(str(_sharded_state_path(path)))
        if parallel_state.get_data_parallel_rank() == 0:
            torch.save(state, path)

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote (collective over data-parallel replicas)."""
        with cpu_shim.cpu_only(), torch.no_grad():
            # Tensors and plain values only: a planted pickle in the trainer state must
            # not run code in the trainer (the format is torch's own, nothing else needed).
            self.optimizer.load_state_dict(torch.load(path, weights_only=True))
            if not self.distributed:
                return
            # ``load_state_dict`` has restored torch Adam's per-parameter ``step``; the
            # gathered parameter state holds only the weights and moments, and Megatron
            # (without Apex or Transformer Engine's Adam) would look for ``step`` in it.
            # Each parameter also gets its own ``step`` back: Megatron's load hands them
            # one shared tensor, which torch's Adam would advance once per parameter.
            adams = [o.optimizer for o in self.optimizer.chained_optimizers]
            steps = [
                {param: state.pop("step") for param, state in adam.state.items() if "step" in state}
                for adam in adams
            ]
            self.optimizer.load_parameter_state(str(_sharded_state_path(path)))
            for adam, restored in zip(adams, steps, strict=True):
                for param, step in restored.items():
                    adam.state[param]["step"] = step.clone()

    def step(
        self, micro_batches: Sequence[PackedBatch], loss_of: MicroBatchLoss
    ) -> tuple[bool, float, list[Any]]:
        """One optimizer step over ``micro_batches``: ``(applied, grad norm, metrics per
        micro-batch)``; the metrics exist on the last pipeline stage only (elsewhere: [])."""
        with cpu_shim.cpu_only():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            metrics = self._schedule(micro_batches, loss_of, forward_only=False)
            applied, grad_norm, _ = self.optimizer.step()
        return bool(applied), float(grad_norm or 0.0), metrics

    def forward_only(
        self, micro_batches: Sequence[PackedBatch], read: Callable[[int, torch.Tensor], Any]
    ) -> list[Any]:
        """``[read(i, logits of micro-batch i)]`` through the same schedule, no backward
        (last pipeline stage only; elsewhere: [])."""

        def loss_of(index: int, logits: torch.Tensor) -> tuple[torch.Tensor, int, Any]:
            return logits.new_zeros(()), 0, read(index, logits)

        with cpu_shim.cpu_only():
            return self._schedule(micro_batches, loss_of, forward_only=True)

    def _schedule(
        self,
        micro_batches: Sequence[PackedBatch],
        loss_of: Callable[[int, torch.Tensor], tuple[torch.Tensor, int, Any]],
        *,
        forward_only: bool,
    ) -> list[Any]:
        batches = iter(enumerate(micro_batches))

        def forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
            index, packed = next(data)
            logits = packed_logits(model, packed, self.vocab_size)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
                loss, tokens, metrics = loss_of(index, output)
                return loss, torch.tensor(tokens, dtype=torch.int), metrics

            return logits, loss_func

        return list(
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=batches,
                model=[self.model],
                num_microbatches=len(micro_batches),
                seq_length=max(p.total_tokens for p in micro_batches),
                micro_batch_size=1,
                forward_only=forward_only,
            )
        )


def _sharded_state_path(path: Path) -> Path:
    return path.with_suffix(".sharded.pt")
