"""The pieces both ends of a file-less weight update share (engines/inference/weight_sync.py):
bucket plans, the flattened-bucket byte format, tied weights, the shared-memory handles
and their allow-listed unpickler, and a weight group formed by two threads over gloo."""

from __future__ import annotations

import pickle
import random
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from sluice.engines.inference.weight_sync import (
    TensorSpec,
    WeightGroup,
    WeightTransferError,
    deserialize_named_tensors,
    dtype_of,
    flatten,
    plan_buckets,
    serialize_named_tensors,
    shared,
    specs_of,
    unflatten,
    unique_named_tensors,
)


def _f32(name: str, numel: int) -> TensorSpec:
    return TensorSpec(name, "float32", (numel,))


# ------------------------------------------------------------------ bucket plans


def test_buckets_fill_up_to_the_byte_budget_and_no_further() -> None:
    # 16 + 16 = 32 bytes fit a 32-byte bucket; the third 16 would make 48, so it starts
    # the next one.
    specs = [_f32("a", 4), _f32("b", 4), _f32("c", 4)]
    assert plan_buckets(specs, bucket_bytes=32) == [[0, 1], [2]]


def test_a_tensor_larger_than_the_budget_is_a_bucket_of_its_own() -> None:
    # 8 bytes, then 400 (over the 16-byte budget alone), then 8.
    specs = [_f32("small", 2), _f32("big", 100), _f32("tail", 2)]
    assert plan_buckets(specs, bucket_bytes=16) == [[0], [1], [2]]


def test_a_tensor_that_would_start_misaligned_starts_a_new_bucket() -> None:
    # 3 uint8 bytes leave a float32 at byte 3 (not a multiple of 4): split, although the
    # budget has room. 2 bfloat16 bytes before a float32 likewise; 4 int8 bytes do not.
    plan = plan_buckets(
        [TensorSpec("mask", "uint8", (3,)), _f32("w", 2)],
        bucket_bytes=1024,
    )
    assert plan == [[0], [1]]
    assert plan_buckets([TensorSpec("h", "bfloat16", (1,)), _f32("w", 1)], 1024) == [[0], [1]]
    assert plan_buckets([TensorSpec("q", "int8", (4,)), _f32("w", 1)], 1024) == [[0, 1]]


def test_a_budget_below_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        plan_buckets([_f32("a", 1)], bucket_bytes=0)


@pytest.mark.parametrize("seed", range(20))
def test_bucket_plans_keep_order_respect_the_budget_and_align_every_tensor(seed: int) -> None:
    rng = random.Random(seed)
    dtypes = ["float32", "bfloat16", "float16", "int64", "uint8", "bool", "float64"]
    specs = [
        TensorSpec(f"t{i}", rng.choice(dtypes), tuple(rng.randint(0, 5) for _ in range(2)))
        for i in range(rng.randint(1, 30))
    ]
    budget = rng.randint(1, 200)
    plan = plan_buckets(specs, budget)
    # Every tensor exactly once, in the order given.
    assert [i for bucket in plan for i in bucket] == list(range(len(specs)))
    for bucket in plan:
        size = 0
        for i in bucket:
            assert size % dtype_of(specs[i].dtype).itemsize == 0, "a tensor starts misaligned"
            size += specs[i].nbytes
        assert size <= budget or len(bucket) == 1, "a bucket of several tensors over budget"


# ------------------------------------------------------------------ flattened buckets


def test_flatten_then_unflatten_gives_back_bfloat16_bit_for_bit() -> None:
    # Values bfloat16 holds exactly and one it rounds: the bytes travel, not the values.
    original = torch.tensor([[1.0, -2.5], [3.140625, 1e-3]], dtype=torch.bfloat16)
    flat = flatten([original])
    assert flat.dtype == torch.uint8 and flat.numel() == 4 * 2
    ((name, back),) = unflatten(flat, specs_of([("w", original)]))
    assert name == "w" and back.dtype == torch.bfloat16 and back.shape == (2, 2)
    assert torch.equal(back.view(torch.int16), original.view(torch.int16))


def test_flatten_then_unflatten_gives_back_mixed_dtypes_planned_into_buckets() -> None:
    named = [
        ("embed", torch.randn(5, 3)),
        ("mask", torch.tensor([True, False, True])),
        ("norm", torch.randn(3).to(torch.bfloat16)),
        ("steps", torch.tensor([7, -1], dtype=torch.int64)),
        ("half", torch.randn(2, 2).to(torch.float16)),
        ("scale", torch.tensor(0.5, dtype=torch.float64)),
        ("t", torch.randn(4, 2).t()),  # not contiguous: flatten copies it in row order
    ]
    specs = specs_of(named)
    back = []
    for bucket in plan_buckets(specs, bucket_bytes=24):
        flat = flatten(named[i][1] for i in bucket)
        back += unflatten(flat, [specs[i] for i in bucket])
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, sent), (_, received) in zip(named, back, strict=True):
        assert received.dtype == sent.dtype and torch.equal(received, sent)


def test_unflatten_views_the_bucket_without_copying() -> None:
    flat = flatten([torch.arange(4.0)])
    ((_, view),) = unflatten(flat, [_f32("w", 4)])
    assert view.data_ptr() == flat.data_ptr()


def test_unflatten_refuses_a_bucket_longer_than_its_tensors() -> None:
    flat = torch.zeros(17, dtype=torch.uint8)
    with pytest.raises(WeightTransferError, match="bucket holds 17 bytes, its tensors 16"):
        unflatten(flat, [_f32("w", 4)])


def test_unflatten_refuses_a_bucket_shorter_than_its_tensors() -> None:
    flat = torch.zeros(12, dtype=torch.uint8)
    with pytest.raises(WeightTransferError, match="12 bytes"):
        unflatten(flat, [_f32("w", 4)])


def test_unflatten_refuses_a_misaligned_tensor() -> None:
    flat = torch.zeros(3 + 4, dtype=torch.uint8)
    with pytest.raises(WeightTransferError, match="tensor w starts at byte 3"):
        unflatten(flat, [TensorSpec("m", "uint8", (3,)), _f32("w", 1)])


def test_dtype_names_with_or_without_the_torch_prefix_are_read() -> None:
    assert dtype_of("bfloat16") is torch.bfloat16
    assert dtype_of("torch.float16") is torch.float16


@pytest.mark.parametrize("name", ["complex64", "float8_e4m3fn", "fp32", ""])
def test_an_unknown_dtype_is_refused_naming_it(name: str) -> None:
    with pytest.raises(WeightTransferError, match=f"dtype {name!r} is not one of"):
        dtype_of(name)


# ------------------------------------------------------------------ tied weights


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 6, bias=False)
        self.lm_head.weight = self.embed.weight


def test_a_tied_lm_head_is_sent_once_under_the_embeddings_name() -> None:
    model = _TiedLM()
    state = model.state_dict()
    assert "lm_head.weight" in state  # the state dict lists both names
    named = unique_named_tensors(state)
    assert [n for n, _ in named] == ["embed.weight", "norm.weight", "norm.bias"]


def test_untied_tensors_of_equal_values_are_all_sent() -> None:
    # The same values in different storage, and two views at different offsets of one
    # storage (a fused weight split into parts), are distinct tensors.
    fused = torch.zeros(4, 3)
    state = {"a": torch.ones(2), "b": torch.ones(2), "q": fused[:2], "k": fused[2:]}
    assert [n for n, _ in unique_named_tensors(state)] == ["a", "b", "q", "k"]


def test_unique_named_tensors_casts_floating_tensors_only_and_detaches() -> None:
    weight = nn.Parameter(torch.randn(3))
    state = {"w": weight, "ids": torch.tensor([1, 2])}
    (_, w), (_, ids) = unique_named_tensors(state, torch.bfloat16)
    assert w.dtype == torch.bfloat16 and not w.requires_grad
    assert ids.dtype == torch.int64


# ------------------------------------------------------------------ shared memory


def _no_check(specs: object, declared_bytes: int) -> None:
    """A receiver that takes any spec (the served-model check is weight_specs')."""


def test_serialized_handles_give_back_copies_of_the_named_tensors() -> None:
    sent = [
        ("w", shared(torch.arange(6.0).reshape(2, 3))),
        ("ids", shared(torch.tensor([4, 5], dtype=torch.int64))),
        ("h", shared(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))),
    ]
    data = serialize_named_tensors(sent)
    assert len(data) < 2000  # handles, not the bytes
    received = deserialize_named_tensors(data, _no_check)
    assert [n for n, _ in received] == ["w", "ids", "h"]
    for (_, s), (_, r) in zip(sent, received, strict=True):
        assert r.dtype == s.dtype and torch.equal(r, s)
    # The receiver's own memory: what the sender does later cannot reach it.
    sent[0][1][0, 0] = 42.0
    assert received[0][1][0, 0].item() == 0.0


def test_tensors_not_in_shared_memory_cannot_be_serialized() -> None:
    with pytest.raises(WeightTransferError, match="made by shared"):
        serialize_named_tensors([("w", torch.ones(3))])


def _call_pickle(module: str, name: str, argument: str) -> bytes:
    """A protocol-0 pickle of ``[module.name(argument)]``: the shape of any pickle that
    runs code as it loads."""
    return f"(lc{module}\n{name}\n(V{argument}\ntRa.".encode()


def test_the_hand_made_pickle_runs_its_call_under_a_plain_unpickler(tmp_path: Path) -> None:
    # The attack the tests below refuse is real: an ordinary pickle.loads runs it.
    marker = tmp_path / "ran"
    pickle.loads(_call_pickle("builtins", "eval", f"open({str(marker)!r}, 'w').close()"))
    assert marker.exists()


@pytest.mark.parametrize(
    ("module", "name", "argument"),
    [
        ("os", "system", "touch {marker}"),
        ("builtins", "eval", "__import__('pathlib').Path({marker!r}).touch()"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename", "{marker}"),
    ],
)
def test_a_pickle_is_never_unpickled_whatever_it_names(
    tmp_path: Path, module: str, name: str, argument: str
) -> None:
    marker = str(tmp_path / "ran")
    data = _call_pickle(module, name, argument.format(marker=marker))
    with pytest.raises(WeightTransferError, match="not a sluice.tensor_handles/1 JSON document"):
        deserialize_named_tensors(data, _no_check)
    assert not Path(marker).exists()


def test_torchs_own_pickled_handles_are_refused_in_one_line() -> None:
    # What senders sent before: torch's reductions, pickled (protocol 2+).
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401

    data = bytes(ForkingPickler.dumps([("w", shared(torch.ones(3)))]))
    with pytest.raises(WeightTransferError, match="pickle form are refused") as caught:
        deserialize_named_tensors(data, _no_check)
    assert "\n" not in str(caught.value)


def test_bytes_that_are_not_a_handle_document_are_refused() -> None:
    with pytest.raises(WeightTransferError, match="cannot read the tensors sent"):
        deserialize_named_tensors(b"not a document", _no_check)


# ------------------------------------------------------------------ weight groups


def _join(port: int, rank: int, world_size: int, **options) -> dict[str, object]:
    """Start rank `rank` joining in a thread; the dict gets its group or its error."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["group"] = WeightGroup(
                "127.0.0.1", port, rank, world_size, timeout_s=2, **options
            ).connect()
        except WeightTransferError as exc:
            result["error"] = exc

    result["thread"] = thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return result


def test_a_broadcast_from_rank_0_arrives_at_the_other_rank() -> None:
    root = WeightGroup("127.0.0.1", 0, 0, 2, timeout_s=5)
    assert root.port > 0
    peer = _join(root.port, 1, 2)
    root.connect()
    peer["thread"].join(5)
    group = peer["group"]
    try:
        received = torch.zeros(4)
        done = threading.Thread(target=group.broadcast, args=(received,), daemon=True)
        done.start()
        root.broadcast(torch.tensor([1.0, -2.0, 3.5, 0.25]))
        done.join(5)
        assert received.tolist() == [1.0, -2.0, 3.5, 0.25]
    finally:
        group.close()
        root.close()


def test_a_group_of_the_wrong_world_size_fails_within_its_deadline_naming_the_group() -> None:
    root = WeightGroup("127.0.0.1", 0, 0, 3, group_name="short", timeout_s=2)
    peer = _join(root.port, 1, 3, group_name="short")
    started = time.monotonic()
    with pytest.raises(WeightTransferError, match="weight group 'short' did not form") as caught:
        root.connect()
    assert time.monotonic() - started < 2 + 3
    assert "rank 0 of 3" in str(caught.value) and "\n" not in str(caught.value)
    peer["thread"].join(5)
    assert "weight group 'short' did not form" in str(peer["error"])
    root.close()


def test_a_group_that_does_not_form_states_its_deadline_as_set() -> None:
    root = WeightGroup("127.0.0.1", 0, 0, 2, group_name="alone", timeout_s=0.5)
    with pytest.raises(WeightTransferError, match="within 0.5 s"):
        root.connect()


def test_joining_a_port_where_nobody_listens_fails_in_one_line() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(WeightTransferError, match="cannot reach the rendezvous") as caught:
        WeightGroup("127.0.0.1", port, 1, 2, timeout_s=1)
    # torch's store retries once after its first try times out.
    assert time.monotonic() - started < 3 * 1 + 2
    assert f"127.0.0.1:{port}" in str(caught.value) and "\n" not in str(caught.value)


def test_hosting_on_a_port_already_taken_fails_in_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(WeightTransferError, match=f"127.0.0.1:{port}") as caught:
            WeightGroup("127.0.0.1", port, 0, 2, timeout_s=2)
    assert "\n" not in str(caught.value)


def test_broadcasting_before_connecting_is_refused() -> None:
    root = WeightGroup("127.0.0.1", 0, 0, 2, group_name="idle", timeout_s=2)
    with pytest.raises(WeightTransferError, match="weight group 'idle' is not connected"):
        root.broadcast(torch.zeros(1))


@pytest.mark.parametrize(
    ("rank", "world_size", "backend", "message"),
    [
        (0, 1, "gloo", "world_size >= 2"),
        (2, 2, "gloo", "0 <= rank < world_size"),
        (0, 2, "mpi", "backend 'mpi' is not gloo or nccl"),
    ],
)
def test_a_group_that_cannot_exist_is_refused_before_any_socket(
    rank: int, world_size: int, backend: str, message: str
) -> None:
    with pytest.raises(WeightTransferError, match=message):
        WeightGroup("127.0.0.1", 1, rank, world_size, backend=backend)
