"""Megatron-core GPTModel from a Hugging Face policy: exact weights in and out, same log-probs.

Runs in this process as a world of one under gloo (``sluice.engines.megatron.cpu_shim``
patches what megatron-core needs to run without CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sluice.engines.inference.weights import read_weight_files
from sluice.engines.megatron import convert
from sluice.engines.megatron import model as megatron_model
from sluice.engines.rl.batching import pack_sequences, register_packed_attention
from tests.conftest import small_qwen2_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    from megatron.core import parallel_state

    started_here = not torch.distributed.is_initialized()
    megatron_model.initialize_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if started_here:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module", params=["llama-tied-gqa", "qwen2-untied-qkv-bias"])
def policy_dir(request: pytest.FixtureRequest, random_model_dir: Callable[..., Path]) -> Path:
    if request.param.startswith("llama"):
        return random_model_dir(seed=3, tie_word_embeddings=True)
    # Untied embeddings and q/k/v biases: the other layout the conversion carries.
    config = small_qwen2_config(tie_word_embeddings=False, use_sliding_window=False)
    return random_model_dir(seed=4, config=config)


def _megatron_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}


def test_hf_to_megatron_to_hf_round_trips_bit_exact(policy_dir: Path) -> None:
    model, hf_config = megatron_model.load_hf_policy(policy_dir)
    back = convert.megatron_to_hf(_megatron_weights(model), hf_config)
    saved = read_weight_files(policy_dir)
    assert set(back) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(back[name], tensor), name


def test_megatron_log_probs_match_hugging_face_on_a_packed_batch(policy_dir: Path) -> None:
    """Sequences packed back to back: RoPE and attention restart at every boundary."""
    model, _ = megatron_model.load_hf_policy(policy_dir)
    hf = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    hf.set_attn_implementation(register_packed_attention())
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 40, (n,), generator=generator) for n in (7, 19, 4, 12)]
    packed = pack_sequences(sequences)
    model.eval()
    with torch.no_grad():
        ours = megatron_model.packed_logits(model, packed).log_softmax(-1)
        theirs = hf(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            **packed.attention_kwargs(),
        ).logits[0]
    targets = packed.input_ids[0, 1:]
    ours_token = ours[:-1].gather(1, targets[:, None])
    theirs_token = theirs.log_softmax(-1)[:-1].gather(1, targets[:, None])
    torch.testing.assert_close(ours_token, theirs_token, rtol=0, atol=1e-5)


def test_megatron_gradients_match_hugging_face_after_conversion(policy_dir: Path) -> None:
    """The same loss on both models gives the same gradient, in HF's layout.

    The padding token (2 in the Llama's config) is among the inputs: HF's embedding
    gives the pad row no gradient from its lookups, and Megatron's must not either."""
    model, hf_config = megatron_model.load_hf_policy(policy_dir)
    hf = AutoModelForCausalLM.from_pretrained(policy_dir)
    hf.set_attn_implementation(register_packed_attention())
    packed = pack_sequences([torch.arange(3, 14), torch.tensor([20, 21, 2, 22, 23, 2, 24, 25])])
    targets = packed.input_ids[0, 1:]

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return -logits.float().log_softmax(-1)[:-1].gather(1, targets[:, None]).mean()

    loss_of(megatron_model.packed_logits(model, packed)).backward()
    loss_of(
        hf(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            **packed.attention_kwargs(),
        ).logits[0]
    ).backward()
    grads = {
        name: p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        for name, p in model.named_parameters()
    }
    ours = convert.megatron_to_hf(grads, hf_config)
    for name, param in hf.named_parameters():
        if name == "lm_head.weight" and hf_config.tie_word_embeddings:
            continue
        torch.testing.assert_close(ours[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_configs_megatron_would_compute_differently_are_refused_by_name(
    overrides: dict, named: str
) -> None:
    from tests.conftest import small_llama_config

    with pytest.raises(convert.UnsupportedModelError, match=named):
        convert.check_supported(small_llama_config(**overrides))


def test_megatron_optimizer_and_schedule_train_like_torch_adamw(policy_dir: Path) -> None:
    """Three optimizer steps of decoupled PPO over two packed micro-batches: Megatron's
    DDP, Adam, clipping and forward-backward schedule land on the weights torch's AdamW
    reaches from the same start (float32; the gap is float rounding of the two paths)."""
    from sluice.engines.megatron.optimizer import MegatronPolicyOptimizer
    from sluice.engines.rl.loss import decoupled_ppo_loss
    from sluice.engines.rl.loss_inputs import LossInputs

    model, hf_config = megatron_model.load_hf_policy(policy_dir)
    hf = AutoModelForCausalLM.from_pretrained(policy_dir)
    hf.set_attn_implementation(register_packed_attention())
    settings = {"lr": 3e-3, "adam_betas": (0.9, 0.95), "adam_eps": 1e-5, "grad_clip": 0.5}
    ours = MegatronPolicyOptimizer(model, weight_decay=0.0, **settings)
    theirs = torch.optim.AdamW(
        hf.parameters(),
        lr=settings["lr"],
        betas=settings["adam_betas"],
        eps=settings["adam_eps"],
        weight_decay=0.0,
    )
    generator = torch.Generator().manual_seed(1)
    micro_batches = [
        pack_sequences([torch.randint(3, 40, (n,), generator=generator) for n in lengths])
        for lengths in ((9, 14), (6, 11, 8))
    ]
    # Every token after the first of each sequence is a "response" token here.
    targets = [p.input_ids[0, 1:] for p in micro_batches]
    keep = [p.position_ids[0, 1:] > 0 for p in micro_batches]
    advantages = [torch.randn(t.shape, generator=generator) for t in targets]
    behaviour = [-3.0 + 0.1 * torch.randn(t.shape, generator=generator) for t in targets]
    total = sum(int(k.sum()) for k in keep)

    def token_logprobs(index: int, logits: torch.Tensor) -> torch.Tensor:
        logp = logits.float().log_softmax(-1)[:-1].gather(1, targets[index][:, None])[:, 0]
        return logp[keep[index]]

    def loss(index: int, logprobs: torch.Tensor, denominator: int) -> torch.Tensor:
        k = keep[index]
        value, _ = decoupled_ppo_loss(
            LossInputs(
                logprobs=logprobs,
                proximal_logprobs=behaviour[index][k],
                behaviour_logprobs=behaviour[index][k],
                advantages=advantages[index][k],
                loss_mask=torch.ones(int(k.sum()), dtype=torch.bool),
                num_global_tokens=denominator,
            )
        )
        return value

    for _ in range(3):
        applied, norm, _ = ours.step(
            micro_batches,
            lambda i, logits: (loss(i, token_logprobs(i, logits), 1), int(keep[i].sum()), {}),
        )
        theirs.zero_grad()
        for i, packed in enumerate(micro_batches):
            logits = hf(
                input_ids=packed.input_ids,
                position_ids=packed.position_ids,
                use_cache=False,
                **packed.attention_kwargs(),
            ).logits[0]
            loss(i, token_logprobs(i, logits), total).backward()
        their_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), settings["grad_clip"])
        theirs.step()
        assert applied
        assert norm == pytest.approx(float(their_norm), rel=1e-4)

    trained = convert.megatron_to_hf(_megatron_weights(model), hf_config)
    for name, param in hf.named_parameters():
        if name == "lm_head.weight" and hf_config.tie_word_embeddings:
            continue
        torch.testing.assert_close(trained[name], param.detach(), rtol=0, atol=2e-5, msg=name)
    # And the weights did move: three steps at this rate are far above the tolerance.
    start = read_weight_files(policy_dir)
    moved = max(float((trained[n] - start[n]).abs().max()) for n in start)
    assert moved > 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim only acts without CUDA")
def test_the_cpu_shim_patches_torch_only_inside_its_block() -> None:
    from sluice.engines.megatron import cpu_shim

    def patched() -> tuple:
        return (
            torch.zeros,
            torch.tensor,
            torch.Tensor.cuda,
            torch.Tensor.type,
            torch.cuda.current_device,
            torch.cuda.synchronize,
        )

    before = patched()
    with cpu_shim.cpu_only():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.cuda.current_device() == "cpu"
        assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(2).type(torch.int64).dtype == torch.int64
    assert patched() == before
    assert torch.ones(2).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):  # no CUDA: asking for it still fails
        torch.zeros(2, device="cuda")


def test_tensor_parallel_shards_merge_back_bit_exact(policy_dir: Path) -> None:
    from transformers import AutoConfig

    size = 2  # the suite's models have two key/value heads
    hf_config = AutoConfig.from_pretrained(policy_dir)
    full = convert.hf_to_megatron(read_weight_files(policy_dir), hf_config)
    shards = [convert.tensor_parallel_shard(full, hf_config, r, size) for r in range(size)]
    # Every sharded tensor really is split: no rank holds a whole projection.
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[0][qkv].shape[0] * size == full[qkv].shape[0]
    merged = convert.tensor_parallel_merge(shards, hf_config)
    assert set(merged) == set(full)
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor), name

    with pytest.raises(convert.UnsupportedModelError, match=r"num_key_value_heads \(2\)"):
        convert.tensor_parallel_shard(full, hf_config, 0, 4)
    with pytest.raises(
        convert.UnsupportedModelError,
        match=r"tensor_parallel=3 must divide the policy's num_attention_heads \(4\)",
    ):
        convert.check_tensor_parallel(hf_config, 3)


def test_pipeline_stages_merge_back_bit_exact(policy_dir: Path) -> None:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(policy_dir)  # two layers: one per stage
    full = convert.hf_to_megatron(read_weight_files(policy_dir), hf_config)
    first, last = (convert.pipeline_stage(full, hf_config, s, 2) for s in range(2))
    # Each stage numbers its own layers from 0; only the first embeds, only the last
    # normalises and projects (with its own copy of a tied embedding).
    assert {n.split(".")[2] for n in first if n.startswith("decoder.layers.")} == {"0"}
    assert torch.equal(
        last["decoder.layers.0.mlp.linear_fc2.weight"],
        full["decoder.layers.1.mlp.linear_fc2.weight"],
    )
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert (
        "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" not in last
    )
    if hf_config.tie_word_embeddings:
        assert torch.equal(last["output_layer.weight"], full["embedding.word_embeddings.weight"])
    merged = convert.pipeline_merge([first, last], hf_config)
    assert set(merged) == set(full)
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor), name

    with pytest.raises(
        convert.UnsupportedModelError,
        match=r"pipeline_parallel=3 must divide the policy's num_hidden_layers \(2\)",
    ):
        convert.check_pipeline_parallel(hf_config, 3)
