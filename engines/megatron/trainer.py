"""The policy trainer on Megatron-core: ``trainer.backend: megatron``.

Everything algorithmic is ``sluice.engines.rl.trainer.PolicyTrainer``'s: the π_prox pass, rollout
correction, PPO minibatches, dynamic micro-batching and the loss function. This class
replaces only what touches the model: the forward pass (a Megatron ``GPTModel`` over
the packed micro-batch), the optimizer step (Megatron's DDP, Adam, gradient clipping
and ``get_forward_backward_func``, see ``sluice.engines.megatron.optimizer``) and saving, which
writes the Hugging Face directory that the inference engine and SGLang load.

Parallel sizes: a world of ``tensor_parallel × pipeline_parallel × data_parallel``
processes runs one of these per rank, every rank making the same calls with the same
samples (see ``sluice.engines.megatron.lockstep``). Under pipeline parallelism only the last
stage sees logits: log-probs and loss metrics computed there are broadcast to the
other stages. Data-parallel replicas take every k-th micro-batch of a minibatch (and
of the π_prox pass) and Megatron sums their gradients and token counts, so the update
is the whole minibatch's.

Departure from the torch backend: Megatron's Adam applies no weight decay to biases
and norm weights (the torch backend decays every parameter); the two agree at the
default ``weight_decay=0``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state

from sluice.engines.megatron import convert
from sluice.engines.megatron.model import initialize_parallel, load_hf_policy, packed_logits
from sluice.engines.megatron.optimizer import MegatronPolicyOptimizer
from sluice.engines.rl.batching import PackedBatch
from sluice.engines.rl.loss_inputs import PolicyLoss
from sluice.engines.rl.rollout_correction import RolloutCorrectionFn
from sluice.engines.rl.train_batch import TrainerSettings
from sluice.engines.rl.trainer import (
    OPTIMIZER_FILE,
    TRAINER_STATE_FILE,
    MicroBatchLossFn,
    PolicyTrainer,
)


class MegatronPolicyTrainer(PolicyTrainer):
    """``PolicyTrainer`` whose policy is a Megatron ``GPTModel`` (any parallel sizes)."""

    backend = "megatron"
    supports_update_fence = False  # its optimizer steps inside Megatron's schedule
    free_proximal = False
    """Megatron takes its optimizer step inside its forward-backward schedule, so the
    correction and the watchdog have no place between backward and step: the π_prox
    pass runs over the whole batch first (`PolicyTrainer._proximal_is_free`)."""
    shard_home: Path | None = None
    """Where this rank writes its optimizer shard when rank 0's checkpoint directory is
    not on its file system (a rank on another machine): the shard then travels to rank
    0 over a gloo group, and rank 0 writes it beside its own. None: rank 0's directory
    is this rank's too (one machine, or a shared file system)."""

    def __init__(
        self,
        model_dir: str | Path,
        settings: TrainerSettings,
        loss_fn: PolicyLoss,
        correction_fn: RolloutCorrectionFn | None,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        decoupled: bool = True,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        data_parallel: int = 1,
        distributed_optimizer: bool = False,
    ):
        """As ``PolicyTrainer``; in a world of more than one process, every rank
        constructs one and calls each method in step, with the same samples. The world
        must hold ``tensor × pipeline × data`` processes."""
        if settings.shared_prompt:
            raise ValueError(
                "shared_prompt needs the torch trainer: Megatron's attention has no branch mask"
            )
        initialize_parallel(tensor_parallel, pipeline_parallel)
        replicas = parallel_state.get_data_parallel_world_size()
        if replicas != data_parallel:
            raise ValueError(
                f"a world of {torch.distributed.get_world_size()} processes at "
                f"tensor_parallel={tensor_parallel} and pipeline_parallel={pipeline_parallel} "
                f"holds {replicas} data-parallel replicas, not data_parallel={data_parallel}"
            )
        # Every replica needs a micro-batch, and a pipeline needs as many as it has stages
        # before its bubble stops dominating.
        settings = dataclasses.replace(
            settings,
            min_micro_batches=max(settings.min_micro_batches, replicas * pipeline_parallel),
        )
        # Shards that travel to rank 0 (`shard_home`) go over gloo whatever the backend.
        self._files_group = (
            torch.distributed.new_group(backend="gloo")
            if tensor_parallel * pipeline_parallel > 1
            else None
        )
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
            use_distributed_optimizer=distributed_optimizer,
        )
        super().__init__(
            model_dir,
            settings,
            loss_fn,
            correction_fn,
            device=device,
            # The published directory is float32 whatever the training precision: a
            # bf16 model keeps its norms in float32, and a resumed run must read back
            # exactly the weights it wrote.
            dtype=torch.float32,
            decoupled=decoupled,
        )

    # PolicyTrainer's constructor builds a Hugging Face model and a torch optimizer; here
    # the HF model is only the skeleton that ``save`` fills, and the optimizer is
    # Megatron's.
    def _make_optimizer(self) -> Any:
        return self.policy_optimizer.optimizer

    def _optimizer_file(self) -> str:
        # Each model-parallel rank holds the Adam state of its own shard; the first
        # data-parallel replica writes it (gathered, with the distributed optimizer).
        tp = parallel_state.get_tensor_model_parallel_rank()
        pp = parallel_state.get_pipeline_model_parallel_rank()
        return (
            OPTIMIZER_FILE.removesuffix(".pt")
            + (f".tp{tp}" if tp else "")
            + (f".pp{pp}" if pp else "")
            + ".pt"
        )

    def _saved_state(self) -> dict[str, Any]:
        return {**super()._saved_state(), **self._layout()}

    def _layout(self) -> dict[str, int | bool]:
        """How the optimizer state is split: what a resumed trainer must match."""
        layout: dict[str, int | bool] = {
            "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_parallel": parallel_state.get_pipeline_model_parallel_world_size(),
            "distributed_optimizer": self.policy_optimizer.distributed,
        }
        if self.policy_optimizer.distributed:  # sharded across replicas too
            layout["data_parallel"] = parallel_state.get_data_parallel_world_size()
        return layout

    def _load_optimizer_state(self, path: Path) -> None:
        state_file = path.parent / TRAINER_STATE_FILE
        saved = json.loads(state_file.read_text()) if state_file.exists() else {}
        defaults = {"distributed_optimizer": False}
        written = {key: saved.get(key, defaults.get(key, 1)) for key in self._layout()}
        if written != self._layout():
            sizes = ", ".join(f"trainer.{key}={value}" for key, value in written.items())
            raise ValueError(
                f"{str(path.parent)!r} holds optimizer state written with {sizes}; "
                "resume it with those settings"
            )
        self.policy_optimizer.load(path.parent / self._optimizer_file())

    def _logits(self, packed: PackedBatch) -> torch.Tensor:
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise RuntimeError("under pipeline parallelism logits exist on the last stage only")
        return packed_logits(self.megatron, packed, int(self.hf_config.vocab_size))

    def _set_training(self, training: bool) -> None:
        self.megatron.train(training)

    def _map_logits(
        self, micro_batches: list[PackedBatch], read: Callable[[int, torch.Tensor], Any]
    ) -> list[Any]:
        mine = _data_parallel_share(len(micro_batches))
        values = self.policy_optimizer.forward_only(
            [micro_batches[i] for i in mine], lambda j, logits: read(mine[j], logits)
        )
        return _gather_data_parallel(mine, _from_last_stage(values), len(micro_batches))

    def _optimizer_step(
        self,
        micro_batches: list[PackedBatch],
        token_counts: list[int],
        loss_of: MicroBatchLossFn,
        check: Callable[[], bool] | None = None,
    ) -> tuple[float, list[dict[str, torch.Tensor]]]:
        # free_proximal is False here: the π_prox pass runs first, so nothing is
        # left to settle between the backward passes and the step.
        assert check is None, "the Megatron backend steps inside its schedule"
        # Megatron's per-token mode wants each micro-batch's token *sum* and divides by the
        # total count itself (over every replica); the shared loss is normalised by that
        # total, so scale back.
        total = sum(token_counts)
        mine = _data_parallel_share(len(micro_batches))
        # A replica left without a micro-batch still joins the gradient all-reduce: it
        # runs one with zero weight and counts no tokens.
        idle = not mine
        if idle:
            mine = [0]

        def loss(j: int, logits: torch.Tensor) -> tuple[torch.Tensor, int, Any]:
            value, parts = loss_of(mine[j], logits)
            if idle:
                return value * 0.0, 0, None
            return value * total, token_counts[mine[j]], parts

        _, grad_norm, parts = self.policy_optimizer.step([micro_batches[i] for i in mine], loss)
        gathered = _gather_data_parallel(
            [] if idle else mine, [] if idle else _from_last_stage(parts), len(micro_batches)
        )
        return grad_norm, gathered

    def _shards_to_rank0(self, out: Path, home: Path | None) -> None:
        """Every file this rank wrote into `home` (its shard, away from rank 0's file
        system), written by rank 0 into `out`. Collective over the world: each rank
        sends what it has (nothing, from a rank beside rank 0)."""
        if self._files_group is None:
            return
        files = sorted(p for p in home.iterdir() if p.is_file()) if home is not None else []
        payload = [(p.name, p.read_bytes()) for p in files]
        rank0 = torch.distributed.get_rank() == 0
        gathered: list[Any] | None = [None] * torch.distributed.get_world_size() if rank0 else None
        torch.distributed.gather_object(payload, gathered, dst=0, group=self._files_group)
        for name, data in (item for sent in gathered or [] for item in sent or []):
            temporary = out / f".{name}.partial"
            temporary.write_bytes(data)
            temporary.replace(out / name)
        for path in files:  # on rank 0's side now
            path.unlink()

    def _barrier(self) -> None:
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the current weights in Hugging Face names and layout (collective:
        every rank must call it; each gets the whole model)."""
        weights = {
            name: tensor.detach().clone()
            for name, tensor in self.megatron.state_dict().items()
            if not name.endswith("._extra_state")
        }
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        if tp_size * pp_size > 1:
            shards: list[Any] = [None] * (tp_size * pp_size)
            mine = (
                parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_rank(),
                weights,
            )
            torch.distributed.all_gather_object(
                shards, mine, group=parallel_state.get_model_parallel_group()
            )
            by_stage: list[list[dict[str, torch.Tensor]]] = [[{}] * tp_size for _ in range(pp_size)]
            for pp, tp, shard in shards:
                by_stage[pp][tp] = shard
            stages = [convert.tensor_parallel_merge(stage, self.hf_config) for stage in by_stage]
            weights = convert.pipeline_merge(stages, self.hf_config)
        return convert.megatron_to_hf(weights, self.hf_config)

    def _save_weights_and_optimizer(self, out: Path, include_optimizer: bool) -> bool:
        """The first data-parallel replica's ranks write their optimizer state; global
        rank 0 the gathered HF weights, and it returns only once every shard is on disk
        (its caller uploads the directory). Collective: every rank must call ``save``."""
        weights = self.hf_state_dict()
        if include_optimizer:
            home = self.shard_home if torch.distributed.get_rank() != 0 else None
            if home is not None:
                shutil.rmtree(home, ignore_errors=True)
                home.mkdir(parents=True)
            self.policy_optimizer.save((home or out) / self._optimizer_file())
            self._shards_to_rank0(out, home)
        self._barrier()
        if torch.distributed.get_rank() != 0:
            return False
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if self.hf_config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"Megatron -> HF left {missing} missing, {unexpected} unexpected")
        self.model.save_pretrained(out, safe_serialization=True)
        return True


def _data_parallel_share(count: int) -> list[int]:
    """The micro-batch indices this data-parallel replica runs: every k-th, from its rank."""
    return list(
        range(
            parallel_state.get_data_parallel_rank(),
            count,
            parallel_state.get_data_parallel_world_size(),
        )
    )


def _from_last_stage(values: list[Any]) -> list[Any]:
    """The last pipeline stage's ``values`` on every stage of this rank's pipeline."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    box = [values]
    torch.distributed.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return list(box[0])


def _gather_data_parallel(mine: list[int], values: list[Any], count: int) -> list[Any]:
    """Every replica's ``values`` (for the micro-batch indices ``mine``) in index order."""
    if parallel_state.get_data_parallel_world_size() == 1:
        return values
    shares: list[Any] = [None] * parallel_state.get_data_parallel_world_size()
    torch.distributed.all_gather_object(
        shares, list(zip(mine, values, strict=True)), group=parallel_state.get_data_parallel_group()
    )
    ordered: list[Any] = [None] * count
    for share in shares:
        for index, value in share:
            ordered[index] = value
    return ordered
