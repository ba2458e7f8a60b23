"""Inference engine: continuous batching, sampling conventions, interruptible updates."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.kv_cache import decode_buckets
from sluice.engines.inference.rng import counter_uniforms
from sluice.engines.inference.types import (
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    WeightLoadError,
)
from tests.conftest import small_qwen2_config

# The suite's small Llama (tests/conftest.py small_llama_config): vocabulary and EOS token.
VOCAB = 40
EOS = 1

# Tiny models run fastest single-threaded; threads only contend on a shared CPU.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dirs(random_model_dir: Callable[..., Path]) -> dict[str, Path]:
    return {
        "v0": random_model_dir(seed=0),
        "v1": random_model_dir(seed=1),
        # Wider hidden state, same head size: the weights cannot load into v0's engine.
        "wider": random_model_dir(seed=2, hidden_size=64, head_dim=12),
    }


def _engine(model_dir: Path, **kwargs: object) -> InferenceEngine:
    options: dict = {"max_batch_size": 4, "max_seq_len": 96, "seed": 0}
    options.update(kwargs)
    return InferenceEngine(model_dir, **options)


def _hf_logprobs(model_dir: Path, output: GenerationOutput, temperature: float) -> list[float]:
    """log_softmax(logits / T) of each output token under a fresh full-sequence forward."""
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    tokens = torch.tensor([list(output.prompt_token_ids) + output.output_token_ids])
    with torch.no_grad():
        logits = model(tokens).logits[0].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    start = output.prompt_length - 1
    return [logp[start + i, t].item() for i, t in enumerate(output.output_token_ids)]


def _requests(
    n: int, *, temperature: float, seed_base: int | None = 100
) -> list[GenerationRequest]:
    rng = random.Random(7)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 9))]
        params = SamplingParams(
            max_new_tokens=rng.randint(3, 30),
            temperature=temperature,
            seed=None if seed_base is None else seed_base + i,
            top_p=0.9 if i % 3 == 1 else 1.0,
            top_k=5 if i % 3 == 2 else -1,
            ignore_eos=i % 2 == 0,
        )
        out.append(GenerationRequest(prompt, params))
    return out


def test_counter_uniforms_depend_only_on_seed_and_counter() -> None:
    a = counter_uniforms([1, 2, 1], [0, 0, 5])
    b = counter_uniforms([2, 1], [0, 5])
    assert ((a >= 0) & (a < 1)).all()
    assert a[1] == b[0] and a[2] == b[1]
    assert len({*a.tolist()}) == 3
    # A negative seed (SGLang allows i64) is valid and differs from its absolute value.
    assert counter_uniforms([-3], [0])[0] != counter_uniforms([3], [0])[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_batched_generation_matches_one_at_a_time(
    model_dirs: dict[str, Path], temperature: float
) -> None:
    requests = _requests(9, temperature=temperature)
    batched = _engine(model_dirs["v0"], max_batch_size=4).generate(requests)
    single_engine = _engine(model_dirs["v0"], max_batch_size=1)
    for request, got in zip(requests, batched, strict=True):
        alone = single_engine.generate([request])[0]
        assert got.output_token_ids == alone.output_token_ids
        assert got.finish_reason == alone.finish_reason
        assert got.behaviour_logprobs == pytest.approx(alone.behaviour_logprobs, abs=1e-5)


def test_a_batch_submitted_at_once_to_a_running_engine_matches_in_process_generate(
    model_dirs: dict[str, Path],
) -> None:
    # A server queues one request's samples with submit_many while its scheduler thread
    # runs; the next step must find them all, as in-process generate() does, or the
    # rows batched together (and the log-probs' last bits) differ.
    requests = _requests(9, temperature=1.0)
    reference = _engine(model_dirs["v0"]).generate(requests)

    def slowly() -> Iterator[GenerationRequest]:  # time for the scheduler to step between
        for request in requests:
            time.sleep(0.01)
            yield request

    engine = _engine(model_dirs["v0"])
    engine.start()
    try:
        for _ in range(2):
            ids = engine.submit_many(slowly())
            served = [engine.future(i).result(timeout=60) for i in ids]
            for request_id in ids:
                engine.forget(request_id)
            assert [o.output_token_ids for o in served] == [o.output_token_ids for o in reference]
            assert [o.behaviour_logprobs for o in served] == [
                o.behaviour_logprobs for o in reference
            ]
            first = served[0].admitted_step
            assert [o.admitted_step for o in served[:4]] == [first] * 4  # 4 slots
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="max_seq_len"):
        engine = _engine(model_dirs["v0"])
        engine.submit_many([requests[0], GenerationRequest([3] * 96, SamplingParams())])
    assert engine.num_waiting == 0  # a bad request in the batch queues none of it


def test_decode_buckets_follow_the_falling_lengths_of_resident_rows() -> None:
    assert decode_buckets([30] * 20) == [(0, 20, 30)]
    assert decode_buckets([200] * 4 + [100] * 10 + [20] * 10) == [(0, 14, 200), (14, 24, 20)]
    # Never a range under eight rows, never more than four ranges.
    assert decode_buckets([200] * 3 + [10] * 20) == [(0, 8, 200), (8, 23, 10)]
    assert decode_buckets([200] * 3 + [10] * 7) == [(0, 10, 200)]
    lengths = [2**k for k in range(12, 0, -1) for _ in range(8)]
    assert len(decode_buckets(lengths)) == 4


def test_long_tailed_batch_attends_in_ranges_and_matches_one_at_a_time(
    model_dirs: dict[str, Path],
) -> None:
    # Admitted longest prompt first: the resident lengths fall from slot to slot, so
    # decode attention runs in several ranges; finishing rows shift the others up.
    requests = [
        GenerationRequest(
            [3 + (i + j) % 30 for j in range(70 - 3 * i)],
            SamplingParams(max_new_tokens=4 + i % 7, seed=i, ignore_eos=True),
        )
        for i in range(20)
    ]
    engine = _engine(model_dirs["v0"], max_batch_size=20, max_seq_len=96)
    batched = engine.generate(requests)
    single = _engine(model_dirs["v0"], max_batch_size=1, max_seq_len=96)
    for request, got in zip(requests, batched, strict=True):
        alone = single.generate([request])[0]
        assert got.output_token_ids == alone.output_token_ids
        assert got.behaviour_logprobs == pytest.approx(alone.behaviour_logprobs, abs=1e-5)


def test_sampling_is_not_degenerate(model_dirs: dict[str, Path]) -> None:
    """Different seeds give different responses; greedy ignores the seed."""
    prompt = [5, 6, 7]
    engine = _engine(model_dirs["v0"])
    sampled = engine.generate(
        [
            GenerationRequest(prompt, SamplingParams(max_new_tokens=12, seed=s, ignore_eos=True))
            for s in range(4)
        ]
    )
    assert len({tuple(o.output_token_ids) for o in sampled}) > 1
    greedy = engine.generate(
        [
            GenerationRequest(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, seed=s))
            for s in range(3)
        ]
    )
    assert len({tuple(o.output_token_ids) for o in greedy}) == 1


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_behaviour_logprobs_are_tempered_log_softmax_of_a_fresh_forward(
    model_dirs: dict[str, Path], temperature: float
) -> None:
    # top_p and top_k restrict sampling only: the logprob is still taken under
    # the full tempered distribution, which is what the trainer recomputes.
    requests = [
        GenerationRequest(
            [4, 9, 11], SamplingParams(max_new_tokens=20, temperature=temperature, seed=3)
        ),
        GenerationRequest(
            [8],
            SamplingParams(max_new_tokens=20, temperature=temperature, seed=4, top_p=0.8, top_k=6),
        ),
    ]
    for output in _engine(model_dirs["v0"]).generate(requests):
        expected = _hf_logprobs(model_dirs["v0"], output, temperature)
        assert output.behaviour_logprobs == pytest.approx(expected, abs=1e-5)


def test_top_k_one_equals_greedy(model_dirs: dict[str, Path]) -> None:
    engine = _engine(model_dirs["v0"])
    prompt = [3, 14, 15]
    greedy = engine.generate(
        [GenerationRequest(prompt, SamplingParams(max_new_tokens=15, temperature=0.0))]
    )
    top1 = engine.generate(
        [GenerationRequest(prompt, SamplingParams(max_new_tokens=15, top_k=1, seed=9))]
    )
    assert greedy[0].output_token_ids == top1[0].output_token_ids


@pytest.mark.parametrize("fast", [True, False], ids=["fast-forward", "hf-forward"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_and_decode_match_full_forward_for_llama_and_qwen2(
    random_model_dir: Callable[..., Path], arch: str, fast: bool
) -> None:
    if arch == "qwen2":
        config: Qwen2Config | None = small_qwen2_config()
        model_cls: type = Qwen2ForCausalLM
    else:
        config, model_cls = None, LlamaForCausalLM  # the suite's small Llama
    model_dir = random_model_dir(seed=5, config=config)
    engine = _engine(model_dir, fast_forward=fast)
    assert (engine._batch.fast is not None) == fast
    outputs = engine.generate(
        [
            GenerationRequest(
                list(range(3, 3 + n)), SamplingParams(max_new_tokens=25, seed=n, ignore_eos=True)
            )
            for n in (1, 4, 7)
        ]
    )
    model = model_cls.from_pretrained(model_dir).eval()
    for output in outputs:
        tokens = torch.tensor([list(output.prompt_token_ids) + output.output_token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens).logits[0].float(), dim=-1)
        start = output.prompt_length - 1
        expected = [logp[start + i, t].item() for i, t in enumerate(output.output_token_ids)]
        assert output.behaviour_logprobs == pytest.approx(expected, abs=1e-5)


def _group_requests(prompts: list[list[int]], group: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt, SamplingParams(max_new_tokens=12, seed=100 * p + k))
        for p, prompt in enumerate(prompts)
        for k in range(group)
    ]


def test_prompt_cache_prefills_each_prompt_once_and_changes_no_output(
    model_dirs: dict[str, Path],
) -> None:
    prompts = [list(range(3, 20)), list(range(5, 11)), [7, 8, 9]]
    requests = _group_requests(prompts, group=5)
    cached = _engine(model_dirs["v0"], max_batch_size=8)
    uncached = _engine(model_dirs["v0"], max_batch_size=8, prompt_cache_size=0)
    with_cache, without = cached.generate(requests), uncached.generate(requests)
    # 15 admissions, 3 distinct prompts: only the first of each runs a forward.
    assert cached.prefilled_tokens == sum(len(p) for p in prompts)
    assert uncached.prefilled_tokens == 5 * sum(len(p) for p in prompts)
    for a, b in zip(with_cache, without, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.behaviour_logprobs == pytest.approx(b.behaviour_logprobs, abs=1e-5)


def test_prompt_cache_is_dropped_when_the_weights_change(model_dirs: dict[str, Path]) -> None:
    requests = _group_requests([list(range(3, 20))], group=3)
    engine = _engine(model_dirs["v0"])
    engine.generate(requests)
    engine.update_weights_from_disk(model_dirs["v1"], 1)
    after_update = engine.generate(requests)
    fresh = _engine(model_dirs["v1"], weight_version=1).generate(requests)
    for a, b in zip(after_update, fresh, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.behaviour_logprobs == pytest.approx(b.behaviour_logprobs, abs=1e-5)
        assert set(a.token_versions) == {1}


def test_finished_slot_is_refilled_before_the_longest_request_finishes(
    model_dirs: dict[str, Path],
) -> None:
    engine = _engine(model_dirs["v0"], max_batch_size=2)
    short, long, third = engine.generate(
        [
            GenerationRequest([5, 6], SamplingParams(max_new_tokens=3, ignore_eos=True, seed=1)),
            GenerationRequest([7, 8], SamplingParams(max_new_tokens=40, ignore_eos=True, seed=2)),
            GenerationRequest([9], SamplingParams(max_new_tokens=5, ignore_eos=True, seed=3)),
        ]
    )
    assert len(short.output_token_ids) == 3 and len(long.output_token_ids) == 40
    assert third.admitted_step is not None and long.admitted_step is not None
    # The third prompt joined the running batch right after the short one left.
    assert third.admitted_step == short.finished_step + 1
    assert third.finished_step < long.finished_step
    # Decoding never ran more steps than the longest request needed.
    assert engine.step_count <= 40


def test_stop_token_ends_the_response_and_is_kept(model_dirs: dict[str, Path]) -> None:
    engine = _engine(model_dirs["v0"])
    prompt = [12, 13]
    free = engine.generate(
        [
            GenerationRequest(
                prompt, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
            )
        ]
    )[0]
    stop = free.output_token_ids[4]
    first = free.output_token_ids.index(stop)
    out = engine.generate(
        [
            GenerationRequest(
                prompt,
                SamplingParams(
                    max_new_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)
                ),
            )
        ]
    )[0]
    assert out.finish_reason == "stop" and out.matched_stop_token_id == stop
    assert out.output_token_ids == free.output_token_ids[: first + 1]


def test_eos_ends_the_response_unless_ignored(model_dirs: dict[str, Path]) -> None:
    engine = _engine(model_dirs["v0"], max_seq_len=200)
    requests = [
        GenerationRequest([4], SamplingParams(max_new_tokens=150, seed=s)) for s in range(12)
    ]
    outputs = engine.generate(requests)
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    assert stopped, "expected at least one sample to hit EOS within 150 tokens"
    for o in stopped:
        assert o.output_token_ids[-1] == EOS and EOS not in o.output_token_ids[:-1]
    ignoring = engine.generate(
        [
            GenerationRequest([4], SamplingParams(max_new_tokens=150, seed=s, ignore_eos=True))
            for s in range(12)
        ]
    )
    assert all(o.finish_reason == "length" and len(o.output_token_ids) == 150 for o in ignoring)


def test_max_seq_len_caps_the_response_with_length(model_dirs: dict[str, Path]) -> None:
    engine = _engine(model_dirs["v0"], max_seq_len=16)
    out = engine.generate(
        [GenerationRequest([3] * 10, SamplingParams(max_new_tokens=50, ignore_eos=True))]
    )[0]
    assert out.finish_reason == "length"
    assert out.prompt_length + len(out.output_token_ids) == 16


def test_zero_max_new_tokens_finishes_immediately(model_dirs: dict[str, Path]) -> None:
    engine = _engine(model_dirs["v0"])
    out = engine.generate([GenerationRequest([3, 4], SamplingParams(max_new_tokens=0))])[0]
    assert out.output_token_ids == [] and out.finish_reason == "length"


@pytest.mark.parametrize("source", ["disk", "tensors in two parts"])
def test_weight_update_mid_generation_switches_versions_and_recomputes_kv(
    model_dirs: dict[str, Path], source: str
) -> None:
    """Whichever way the weights arrive (a checkpoint, or tensors from another process
    in buckets: `update_weights_from_tensors`), the update lands between two decode
    steps, in-flight KV is recomputed and later tokens carry the new version."""
    engine = _engine(model_dirs["v0"], max_batch_size=3)
    temperature = 0.8
    ids = [
        engine.submit(
            GenerationRequest(
                p,
                SamplingParams(max_new_tokens=30, temperature=temperature, seed=i, ignore_eos=True),
            )
        )
        for i, p in enumerate([[3, 4, 5], [6], [7, 8, 9, 10]])
    ]
    for _ in range(6):
        engine.step()
    if source == "disk":
        report = engine.update_weights_from_disk(model_dirs["v1"], 1)
    else:
        from sluice.engines.inference.weights import read_weight_files

        named = list(read_weight_files(model_dirs["v1"]).items())
        half = len(named) // 2
        assert engine.update_weights_from_tensors(named[:half], 1) is None  # staged
        assert engine.weight_version == 0  # nothing served of version 1 yet
        engine.step()  # generation goes on between the parts, on version 0
        report = engine.update_weights_from_tensors(named[half:], 1)
        assert report is not None
    assert report.num_recomputed_requests == 3 and engine.weight_version == 1
    outputs = [engine.result(i) for i in ids]
    assert engine.recomputed_tokens > 0
    for out in outputs:
        switch = out.token_versions.index(1)
        # Six steps (seven between two parts): one token from prefill then one per decode step.
        assert switch == (7 if source == "disk" else 8)
        assert out.token_versions == [0] * switch + [1] * (30 - switch)
        old = _hf_logprobs(model_dirs["v0"], out, temperature)
        new = _hf_logprobs(model_dirs["v1"], out, temperature)
        assert out.behaviour_logprobs[:switch] == pytest.approx(old[:switch], abs=1e-5)
        assert out.behaviour_logprobs[switch:] == pytest.approx(new[switch:], abs=1e-5)
        # The two policies really differ on these tokens.
        assert max(abs(a - b) for a, b in zip(old[switch:], new[switch:], strict=True)) > 1e-2


def test_drain_update_finishes_old_requests_with_old_version_then_updates(
    model_dirs: dict[str, Path],
) -> None:
    engine = _engine(model_dirs["v0"], max_batch_size=4)
    engine.start()
    try:
        old_ids = [
            engine.submit(
                GenerationRequest(
                    [3 + i], SamplingParams(max_new_tokens=25 + 5 * i, seed=i, ignore_eos=True)
                )
            )
            for i in range(4)
        ]
        deadline = time.monotonic() + 30
        while engine.generated_tokens < 8 and time.monotonic() < deadline:
            time.sleep(0.001)
        reports = []
        updater = threading.Thread(
            target=lambda: reports.append(
                engine.update_weights_from_disk(model_dirs["v1"], 1, drain=True)
            )
        )
        updater.start()
        while not engine.draining and updater.is_alive():  # admission closes as the drain starts
            time.sleep(0.0005)
        late_id = engine.submit(
            GenerationRequest([20], SamplingParams(max_new_tokens=10, seed=9, ignore_eos=True))
        )
        updater.join(timeout=60)
        old = [engine.result(i, timeout_s=60) for i in old_ids]
        late = engine.result(late_id, timeout_s=60)
    finally:
        engine.shutdown()
    assert reports and reports[0].num_recomputed_requests == 0
    for out in old:
        assert out.finish_reason == "length" and set(out.token_versions) == {0}
    assert set(late.token_versions) == {1}
    assert late.behaviour_logprobs == pytest.approx(
        _hf_logprobs(model_dirs["v1"], late, 1.0), abs=1e-5
    )


def test_drain_update_refuses_while_paused_with_requests_in_flight(
    model_dirs: dict[str, Path],
) -> None:
    engine = _engine(model_dirs["v0"])
    rid = engine.submit(
        GenerationRequest([3], SamplingParams(max_new_tokens=8, seed=1, ignore_eos=True))
    )
    engine.step()
    engine.pause("in_place")
    with pytest.raises(RuntimeError, match="continue_generation"):
        engine.update_weights_from_disk(model_dirs["v1"], 1, drain=True)
    assert engine.weight_version == 0 and not engine.draining
    engine.continue_generation()
    assert set(engine.result(rid).token_versions) == {0}


def test_pause_abort_returns_partial_outputs_and_queues_new_requests(
    model_dirs: dict[str, Path],
) -> None:
    engine = _engine(model_dirs["v0"])
    running = engine.submit(
        GenerationRequest([3, 4], SamplingParams(max_new_tokens=40, ignore_eos=True))
    )
    for _ in range(3):
        engine.step()
    assert engine.pause("abort") == 1
    aborted = engine.result(running)
    assert aborted.finish_reason == "abort" and len(aborted.output_token_ids) == 4
    assert len(aborted.behaviour_logprobs) == len(aborted.token_versions) == 4
    queued = engine.submit(
        GenerationRequest([5], SamplingParams(max_new_tokens=5, ignore_eos=True))
    )
    assert engine.step() is False and engine.num_waiting == 1
    engine.continue_generation()
    out = engine.result(queued)
    assert out.finish_reason == "length" and len(out.output_token_ids) == 5


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_continue_without_update_reproduce_the_uninterrupted_run(
    model_dirs: dict[str, Path], mode: str
) -> None:
    requests = _requests(5, temperature=1.0)
    reference = _engine(model_dirs["v0"], max_batch_size=3).generate(requests)
    engine = _engine(model_dirs["v0"], max_batch_size=3)
    ids = [engine.submit(r) for r in requests]
    for _ in range(4):
        engine.step()
    produced = engine.generated_tokens
    engine.pause(mode)
    assert engine.step() is False and engine.generated_tokens == produced
    engine.continue_generation()
    outputs = [engine.result(i) for i in ids]
    for got, want in zip(outputs, reference, strict=True):
        assert got.output_token_ids == want.output_token_ids
        assert got.behaviour_logprobs == pytest.approx(want.behaviour_logprobs, abs=1e-5)
    # retract drops the KV and recomputes it; in_place keeps it.
    assert (engine.recomputed_tokens > 0) == (mode == "retract")


def test_in_place_pause_then_update_recomputes_with_new_weights(
    model_dirs: dict[str, Path],
) -> None:
    engine = _engine(model_dirs["v0"])
    rid = engine.submit(
        GenerationRequest([3, 9], SamplingParams(max_new_tokens=20, seed=5, ignore_eos=True))
    )
    for _ in range(4):
        engine.step()
    engine.pause("in_place")
    engine.update_weights_from_disk(model_dirs["v1"], 1)
    engine.continue_generation()
    out = engine.result(rid)
    switch = out.token_versions.index(1)
    new = _hf_logprobs(model_dirs["v1"], out, 1.0)
    assert out.behaviour_logprobs[switch:] == pytest.approx(new[switch:], abs=1e-5)


def test_abort_one_request_leaves_the_others_running(model_dirs: dict[str, Path]) -> None:
    engine = _engine(model_dirs["v0"], max_batch_size=2)
    ids = [
        engine.submit(
            GenerationRequest([3 + i], SamplingParams(max_new_tokens=20, seed=i, ignore_eos=True))
        )
        for i in range(3)
    ]
    engine.step()
    assert engine.abort(ids[0]) and engine.abort(ids[2])  # one running, one waiting
    assert not engine.abort("no-such-request")
    first, second, third = (engine.result(i) for i in ids)
    assert first.finish_reason == "abort" and len(first.output_token_ids) == 2
    assert third.finish_reason == "abort" and third.output_token_ids == []
    reference = _engine(model_dirs["v0"]).generate(
        [GenerationRequest([4], SamplingParams(max_new_tokens=20, seed=1, ignore_eos=True))]
    )[0]
    assert second.output_token_ids == reference.output_token_ids


def test_bad_requests_are_rejected_with_a_named_error_and_lose_nothing(
    model_dirs: dict[str, Path],
) -> None:
    engine = _engine(model_dirs["v0"], max_seq_len=32)
    good = engine.submit(
        GenerationRequest([3, 4], SamplingParams(max_new_tokens=5, ignore_eos=True))
    )
    bad = [
        (GenerationRequest([], SamplingParams()), "at least one token"),
        (GenerationRequest([3, VOCAB], SamplingParams()), "outside the vocabulary"),
        (GenerationRequest([3] * 32, SamplingParams()), "max_seq_len"),
        (GenerationRequest([3], SamplingParams(temperature=-1.0)), "temperature"),
        (GenerationRequest([3], SamplingParams(top_p=0.0)), "top_p"),
        (GenerationRequest([3], SamplingParams(max_new_tokens=-2)), "max_new_tokens"),
        (GenerationRequest([3], SamplingParams(stop_token_ids=(99,))), "stop_token_ids"),
        (GenerationRequest([3], SamplingParams(), request_id=good), "already in flight"),
    ]
    for request, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.submit(request)
    with pytest.raises(ValueError, match="pause mode"):
        engine.pause("sideways")
    assert engine.num_waiting == 1
    assert len(engine.result(good).output_token_ids) == 5


def test_bad_weight_directories_keep_the_old_weights(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    engine = _engine(model_dirs["v0"])
    rid = engine.submit(
        GenerationRequest([3, 4], SamplingParams(max_new_tokens=12, seed=1, ignore_eos=True))
    )
    engine.step()
    with pytest.raises(WeightLoadError, match="does not exist"):
        engine.update_weights_from_disk(tmp_path / "missing", 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightLoadError, match="no weights"):
        engine.update_weights_from_disk(tmp_path / "empty", 1)
    with pytest.raises(WeightLoadError, match="shape mismatches"):
        engine.update_weights_from_disk(model_dirs["wider"], 1)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightLoadError, match="cannot read"):
        engine.update_weights_from_disk(corrupt, 1)
    assert engine.weight_version == 0
    out = engine.result(rid)
    assert set(out.token_versions) == {0}
    assert out.behaviour_logprobs == pytest.approx(
        _hf_logprobs(model_dirs["v0"], out, 1.0), abs=1e-5
    )


def test_random_schedules_of_pauses_and_updates_lose_no_request(
    model_dirs: dict[str, Path],
) -> None:
    """Invariant: every request finishes exactly once, token-aligned, with versions never decreasing."""
    rng = random.Random(11)
    engine = _engine(model_dirs["v0"], max_batch_size=3)
    ids: list[str] = []
    version = 0
    for _ in range(60):
        action = rng.random()
        if action < 0.35:
            params = SamplingParams(
                max_new_tokens=rng.randint(1, 15),
                seed=rng.randrange(1000),
                ignore_eos=rng.random() < 0.5,
            )
            ids.append(engine.submit(GenerationRequest([rng.randrange(3, VOCAB)], params)))
        elif action < 0.45:
            engine.pause(rng.choice(["abort", "retract", "in_place"]))
        elif action < 0.55:
            engine.continue_generation()
        elif action < 0.6:
            version += 1
            engine.update_weights_from_disk(model_dirs["v1" if version % 2 else "v0"], version)
        else:
            engine.step()
    engine.continue_generation()
    outputs = [engine.result(i) for i in ids]
    assert len({o.request_id for o in outputs}) == len(ids)
    assert engine.num_running == 0 and engine.num_waiting == 0
    for out in outputs:
        n = len(out.output_token_ids)
        assert len(out.behaviour_logprobs) == len(out.token_versions) == n
        assert out.token_versions == sorted(out.token_versions)
        assert all(lp <= 0.0 for lp in out.behaviour_logprobs)
        if out.finish_reason != "abort":
            assert n >= 1


def test_prompt_cache_stays_within_a_quarter_of_the_kv_cache(model_dirs: dict[str, Path]) -> None:
    engine = _engine(model_dirs["v0"], max_batch_size=2, max_seq_len=96, prompt_cache_size=1000)
    kv_bytes = sum(
        t.numel() * t.element_size()
        for t in (*engine._batch.cache.keys, *engine._batch.cache.values)
    )
    for n in range(30):  # 30 distinct prompts, each about a tenth of the K/V cache
        engine.generate(
            [
                GenerationRequest(
                    [3 + (n + j) % 30 for j in range(20)], SamplingParams(max_new_tokens=1)
                )
            ]
        )
    assert 0 < engine._batch.prompts.nbytes <= kv_bytes // 4
    assert len(engine._batch.prompts) < 30
