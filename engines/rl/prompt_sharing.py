"""Shared-prompt packing: a group's prompt runs through the model once, its responses on top.

A GRPO-style step trains G responses to each prompt. Packed one sequence per sample
(:func:`sluice.engines.rl.batching.pack_sequences`), a group's P prompt tokens run
through the model G times: G(P + R̄) tokens a group. Here the prompt is laid out once and
its responses after it, each a branch that attends to the prompt and to its own earlier
tokens only (a tree of depth one), with position ids continuing from P: P + G·R̄ tokens.
On the harder reasoning-gym mix (P ≈ 54, R̄ ≈ 14, G = 8) that is 166 tokens a group
instead of 544.

Nothing the loss sees changes. Every response token's logits are the same function of
the weights as in its own sequence (the prompt's activations are identical in every
copy, so one copy stands for all), and the prompt's gradient is the sum of what each
copy would receive. Only the order of floating-point sums differs. The first response
token of every branch is predicted at the prompt's last position, so that logit row is
read once per branch.

Layout of one packed row: blocks (one per distinct prompt of the micro-batch, in order
of first appearance) delimited by ``cu_seqlens``; inside a block the prompt, then each
branch. ``branch_ids`` marks every token: -1 for the shared prompt, else the branch's
index inside its block. :func:`sluice.engines.rl.batching.packed_causal_attention`
reads it: token q may attend to token k iff k <= q in the row and k is a prompt token
or in q's own branch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.engines.rl.batching import PackedBatch, dynamic_micro_batches

Tensor = torch.Tensor


def prompt_groups(prompts: Sequence[Tensor]) -> list[list[int]]:
    """Indices into ``prompts`` grouped by identical tokens, groups in order of first
    appearance and indices in their given order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(int(t) for t in prompt), []).append(i)
    return list(groups.values())


def shared_prompt_micro_batches(
    prompts: Sequence[Tensor],
    response_lens: Sequence[int],
    max_tokens_per_micro_batch: int,
    min_micro_batches: int = 1,
) -> list[list[int]]:
    """Micro-batches (lists of indices) that keep each prompt's samples together.

    A group is cut into chunks whose shared-prompt cost (P + Σ R) fits the budget, at
    least one sample a chunk; the chunks are then placed by
    :func:`sluice.engines.rl.batching.dynamic_micro_batches` as units, so a chunk is
    never split and a micro-batch holds at most the budget (a lone over-long sample is
    warned about there). ``min_micro_batches`` counts micro-batches, as it does there.
    """
    if len(prompts) != len(response_lens):
        raise ValueError(f"{len(prompts)} prompts but {len(response_lens)} response lengths")
    if max_tokens_per_micro_batch < 1:
        raise ValueError(
            f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}"
        )
    chunks: list[list[int]] = []
    for group in prompt_groups(prompts):
        shared = int(prompts[group[0]].numel())
        chunk: list[int] = []
        tokens = shared
        for i in group:
            if chunk and tokens + response_lens[i] > max_tokens_per_micro_batch:
                chunks.append(chunk)
                chunk, tokens = [], shared
            chunk.append(i)
            tokens += response_lens[i]
        chunks.append(chunk)
    costs = [int(prompts[c[0]].numel()) + sum(response_lens[i] for i in c) for c in chunks]
    plan = dynamic_micro_batches(costs, max_tokens_per_micro_batch, min_micro_batches)
    return [[i for unit in mb for i in chunks[unit]] for mb in plan]


def pack_shared_prompts(prompts: Sequence[Tensor], responses: Sequence[Tensor]) -> PackedBatch:
    """Samples packed into one row with each distinct prompt laid out once.

    Returns a :class:`PackedBatch` whose ``target_positions`` are the response tokens'
    places in the row and ``logit_rows`` the positions that predict them, both in the
    order of the given samples (sample 0's tokens first), so the log-probs read from it
    line up with the flat per-token tensors of the batch.
    """
    if len(prompts) == 0 or len(prompts) != len(responses):
        raise ValueError(
            f"pack_shared_prompts needs as many responses as prompts (>= 1), got "
            f"{len(prompts)} and {len(responses)}"
        )
    prompts = [torch.as_tensor(p, dtype=torch.int64).reshape(-1).cpu() for p in prompts]
    responses = [torch.as_tensor(r, dtype=torch.int64).reshape(-1).cpu() for r in responses]
    empty = [i for i, (p, r) in enumerate(zip(prompts, responses, strict=True)) if not len(p)]
    empty += [i for i, r in enumerate(responses) if not len(r)]
    if empty:
        raise ValueError(f"every sample needs a prompt and a response token (not {empty[:5]})")
    pieces: list[Tensor] = []
    positions: list[Tensor] = []
    branches: list[Tensor] = []
    block_lens: list[int] = []
    targets: list[Tensor] = [torch.empty(0, dtype=torch.int64)] * len(prompts)
    rows: list[Tensor] = [torch.empty(0, dtype=torch.int64)] * len(prompts)
    start = 0
    for group in prompt_groups(prompts):
        prompt = prompts[group[0]]
        shared = prompt.numel()
        pieces.append(prompt)
        positions.append(torch.arange(shared))
        branches.append(torch.full((shared,), -1, dtype=torch.int64))
        cursor = start + shared
        for branch, i in enumerate(group):
            n = responses[i].numel()
            pieces.append(responses[i])
            positions.append(torch.arange(shared, shared + n))
            branches.append(torch.full((n,), branch, dtype=torch.int64))
            targets[i] = torch.arange(cursor, cursor + n)
            # The first token is predicted at the prompt's last position, the rest at
            # the branch's own previous token.
            rows[i] = torch.cat([torch.tensor([start + shared - 1]), targets[i][:-1]])
            cursor += n
        block_lens.append(cursor - start)
        start = cursor
    lengths = torch.tensor(block_lens, dtype=torch.int64)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    return PackedBatch(
        input_ids=torch.cat(pieces).unsqueeze(0),
        position_ids=torch.cat(positions).unsqueeze(0),
        cu_seqlens=cu.to(torch.int32),
        seq_lens=lengths,
        sequence_ids=torch.repeat_interleave(torch.arange(lengths.numel()), lengths),
        max_seqlen=int(lengths.max()),
        logit_rows=torch.cat(rows),
        branch_ids=torch.cat(branches),
        target_positions=torch.cat(targets),
    )
