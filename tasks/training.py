"""What the two training roles share: the asynchronous train role and the colocated sync loop.

Both build the same trainer from the run config, start from the newest durable policy
version, commit each published version to the registry only once its checkpoint is
durable, and leave the same end state: the run's done marker once the last step is
trained, and a final status document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.advantages import AdvantageFn, make_advantage_fn
from engines.loss import make_policy_loss
from engines.model import resolve_device
from engines.rollout_correction import make_rollout_correction
from engines.trainer import PolicyTrainer, TrainerSettings
from infra.checkpoints import save_checkpoint
from infra.config import RunConfig
from infra.registry import CommittedVersion
from tasks.role import Role


def trainer_settings(config: RunConfig) -> TrainerSettings:
    t = config.trainer
    return TrainerSettings(
        lr=t.lr,
        adam_betas=t.adam_betas,
        adam_eps=t.adam_eps,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        temperature=config.rollout.temperature,
        ppo_minibatches=t.ppo_minibatches,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        min_micro_batches=t.min_micro_batches,
        seed=config.seed,
    )


def build_trainer(config: RunConfig, model_dir: Path) -> PolicyTrainer:
    """The policy trainer the run config asks for, on the weights in `model_dir`."""
    t = config.trainer
    correction = make_rollout_correction(**t.correction.model_dump()) if t.loss.decoupled else None
    device = resolve_device(config.device)
    trainer_class = PolicyTrainer
    if t.backend == "megatron":
        from engines.megatron.trainer import MegatronPolicyTrainer

        trainer_class = MegatronPolicyTrainer
    return trainer_class(
        model_dir,
        trainer_settings(config),
        make_policy_loss(**t.loss.model_dump()),
        correction,
        device=device,
        decoupled=t.loss.decoupled,
    )


def advantage_fn(config: RunConfig) -> AdvantageFn:
    """Group advantages as `trainer.advantage` configures them."""
    return make_advantage_fn(**config.trainer.advantage.model_dump())


class TrainingRole(Role):
    """A role that trains the policy and publishes its versions."""

    name = "train"
    finished_note = ""
    """Appended to the done marker's reason ("trained N steps{note}")."""

    def start_version(self) -> CommittedVersion:
        """The newest durable policy version, the one training goes on from.

        A crash between creating a version in the registry and moving the alias leaves
        the alias one version behind; moving it forward first (`sync_alias`) makes a
        resumed role continue from the newest durable version, not retrain into a
        version number that is already taken.
        """
        first = self.wait_for_first_version()
        return self.registry.sync_alias() or first

    def commit_version(self, local: Path, version: int, tags: dict[str, Any]) -> str:
        """Upload the checkpoint in `local`, then commit it as `version`; returns its URI."""
        uri = save_checkpoint(
            local, self.paths.checkpoint(version), storage_options=self.config.storage.options
        )
        self.registry.commit(
            version, uri, run_id=self.mlflow_run_id, tags=tags, trainer_step=version
        )
        return uri

    def finish(self, version: int) -> None:
        """The run's done marker once the last step is trained; the final status either way."""
        total = self.config.trainer.total_steps
        if version >= total:
            self.control.mark_done(f"trained {total} steps{self.finished_note}")
        self.status.update(
            force=True, state="finished" if version >= total else "stopped", step=version
        )
