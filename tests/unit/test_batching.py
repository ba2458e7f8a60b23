"""Dynamic micro-batching and padding-free packing: hand cases, invariants, and a real tiny Llama."""

import random
import warnings

import pytest
import torch

from sluice.engines.rl.batching import (
    OverlongSequenceWarning,
    block_diagonal_causal_mask,
    dynamic_micro_batches,
    fixed_micro_batches,
    pack_sequences,
    pad_sequences,
    padded_tokens,
    register_packed_attention,
    unpack,
)


def test_best_fit_decreasing_by_hand():
    # lengths [5, 3, 8, 2, 6], budget 10, sorted: 8(#2) 6(#4) 5(#0) 3(#1) 2(#3)
    # 8 -> new mb0 (room 2); 6 -> nothing fits, mb1 (room 4); 5 -> nothing fits, mb2 (room 5)
    # 3 -> fits mb1 (4) and mb2 (5): least room is mb1 -> room 1
    # 2 -> fits mb0 (2) and mb2 (5): least room is mb0 -> room 0
    assert dynamic_micro_batches([5, 3, 8, 2, 6], 10) == [[2, 3], [4, 1], [0]]


def test_more_micro_batches_than_the_budget_needs_are_balanced_longest_first():
    # as above (the budget needs 3), but 4 asked for: longest first into the emptiest,
    # 8 -> mb0, 6 -> mb1, 5 -> mb2, 3 -> mb3 (all empty before); 2 -> mb3 (3 tokens,
    # the fewest) -> loads 8, 6, 5, 5
    assert dynamic_micro_batches([5, 3, 8, 2, 6], 10, min_micro_batches=4) == [
        [2],
        [4],
        [0],
        [1, 3],
    ]


def test_forced_micro_batches_differ_by_at_most_the_longest_sequence():
    rng = random.Random(1)
    for _ in range(300):
        lengths = [max(1, int(rng.lognormvariate(3, 1))) for _ in range(rng.randint(2, 60))]
        count = rng.randint(2, 8)
        budget = 10 * sum(lengths)  # the budget alone would need one micro-batch
        mbs = dynamic_micro_batches(lengths, budget, min_micro_batches=count)
        assert len(mbs) == min(count, len(lengths))
        loads = [sum(lengths[i] for i in mb) for mb in mbs]
        assert max(loads) - min(loads) <= max(lengths)


def test_overlong_sequence_gets_its_own_micro_batch_with_a_warning():
    with pytest.warns(OverlongSequenceWarning, match="#0 \\(12 tokens\\)"):
        assert dynamic_micro_batches([12, 3, 4], 10) == [[0], [2, 1]]


def test_packing_never_loses_a_token_or_exceeds_the_budget():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 60)
        budget = rng.randint(1, 200)
        lengths = [max(1, int(rng.lognormvariate(3, 1))) for _ in range(n)]
        min_mb = rng.randint(1, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OverlongSequenceWarning)
            mbs = dynamic_micro_batches(lengths, budget, min_micro_batches=min_mb)
        assert sorted(i for mb in mbs for i in mb) == list(range(n))
        assert all(mb for mb in mbs)
        assert len(mbs) >= min(min_mb, n)
        for mb in mbs:
            tokens = sum(lengths[i] for i in mb)
            assert tokens <= budget or (len(mb) == 1 and lengths[mb[0]] > budget)
        # Any-fit packing leaves at most one micro-batch half empty (a second one's first
        # sequence would have fitted into it), so it uses at most 2 * ceil(total / budget).
        if max(lengths) <= budget and min_mb == 1:
            lower = -(-sum(lengths) // budget)
            assert len(mbs) <= 2 * lower


def test_fixed_micro_batches_are_equal_count_slices_in_order():
    assert fixed_micro_batches([1] * 7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert fixed_micro_batches([4, 2], 5) == [[0], [1]]
    assert padded_tokens([[0, 1, 2], [3, 4]], [1, 5, 2, 3, 3]) == [15, 6]


def test_pack_and_unpack_by_hand():
    packed = pack_sequences([[1, 2, 3], [4], [5, 6]])
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.sequence_ids.tolist() == [0, 0, 0, 1, 2, 2]
    assert packed.max_seqlen == 3
    parts = unpack(packed.input_ids, packed.cu_seqlens)
    assert [p.tolist() for p in parts] == [[1, 2, 3], [4], [5, 6]]


def test_pack_unpack_round_trip_keeps_every_token():
    rng = random.Random(1)
    for _ in range(50):
        seqs = [torch.randint(0, 1000, (rng.randint(1, 40),)) for _ in range(rng.randint(1, 12))]
        packed = pack_sequences(seqs)
        assert packed.total_tokens == sum(s.numel() for s in seqs)
        back = unpack(packed.input_ids, packed.cu_seqlens)
        assert all(torch.equal(a, b) for a, b in zip(seqs, back, strict=True))
        starts = packed.cu_seqlens[:-1].long()
        assert (packed.position_ids[0, starts] == 0).all()


def test_block_diagonal_mask_blocks_cross_sequence_and_future_tokens():
    mask = block_diagonal_causal_mask(torch.tensor([0, 2, 3]))
    assert mask.shape == (1, 1, 3, 3)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]


def test_pad_sequences_right_pads():
    ids, attn = pad_sequences([[7, 8, 9], [5]], pad_token_id=0)
    assert ids.tolist() == [[7, 8, 9], [5, 0, 0]]
    assert attn.tolist() == [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize(("lengths", "message"), [([3, 0], "sequence 1 has length 0")])
def test_bad_lengths_raise_one_clear_error(lengths, message):
    with pytest.raises(ValueError, match=message):
        dynamic_micro_batches(lengths, 8)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 1"):
        dynamic_micro_batches([3], 0)
    with pytest.raises(ValueError, match="cannot pack empty sequences"):
        pack_sequences([[1], []])


def test_packed_row_gives_the_same_logits_as_each_sequence_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention exercises the kv-head repeat
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    seqs = [torch.randint(0, 64, (n,)) for n in (5, 3, 7)]
    packed = pack_sequences(seqs)
    with torch.no_grad():
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
        masked = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=block_diagonal_causal_mask(packed.cu_seqlens),
        ).logits
        model.set_attn_implementation(register_packed_attention())
        varlen = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            **packed.attention_kwargs(),
        ).logits
        # Without the boundaries, later sequences attend to earlier ones and differ.
        model.set_attn_implementation("sdpa")
        leaky = model(
            input_ids=packed.input_ids,
            attention_mask=torch.ones_like(packed.input_ids),
        ).logits
    for expected, got_masked, got_varlen in zip(
        alone, unpack(masked, packed.cu_seqlens), unpack(varlen, packed.cu_seqlens), strict=True
    ):
        torch.testing.assert_close(got_masked, expected)
        torch.testing.assert_close(got_varlen, expected)
    assert not torch.allclose(unpack(leaky, packed.cu_seqlens)[2], alone[2], atol=1e-4)
