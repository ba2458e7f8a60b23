"""Moving a policy version's tensors between processes without a file: the pieces both
ends share (the trainer sends, an inference server receives).

Two transports, with SGLang's wire conventions so a real SGLang server takes the same
calls (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/update_weights_from_tensor``):

- **A process group** (``WeightGroup``): the trainer is rank 0 and hosts the
  rendezvous (a ``TCPStore``); server i is rank ``rank_offset + i``. Gloo on CPU, NCCL
  on GPU. The group is made without torch's default process group, so a trainer that
  already runs one (data parallel ranks) keeps it. Tensors travel as flattened buckets:
  the raw bytes of consecutive tensors concatenated as one ``uint8`` tensor, in the
  order the request's ``names`` lists them (SGLang's ``load_format:
  "flattened_bucket"``). Every collective has a deadline: a peer that dies or never
  comes ends the call in an error, never a hang.
- **Shared memory** (``serialize_named_tensors``): a JSON document of handles
  (``tensor_handles``), so a CPU tensor travels as the name of a shared-memory segment
  and a CUDA tensor as an IPC handle. The receiver checks the document against the
  served architecture, then copies the sender's memory into its own (never a pickle,
  never a lasting mapping); a server takes such a body only from its own host.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sluice.engines.inference.tensor_handles import (
    Checker,
    HandleError,
    decode_handles,
    encode_handles,
)

# The receivers' refusal, re-exported: the serving layer reaches engines through here.
from sluice.engines.inference.weight_specs import SpecMismatch as SpecMismatch

DEFAULT_GROUP_NAME = "weight_update_group"
"""SGLang's default ``group_name``."""
FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's ``load_format`` for a bucket broadcast as one flat byte tensor."""


class WeightTransferError(RuntimeError):
    """A transfer failed (a peer gone, a deadline passed, a body that does not fit); the
    message names the cause. The receiver's weights are unchanged."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a transfer, as a request names it."""

    name: str
    dtype: str
    """torch dtype name without the ``torch.`` prefix (``bfloat16``)."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * dtype_of(self.dtype).itemsize


_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a request names (``bfloat16`` or ``torch.bfloat16``)."""
    dtype = _DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise WeightTransferError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unique_named_tensors(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> list[tuple[str, torch.Tensor]]:
    """``state``'s tensors once each (a tied weight such as an LM head sharing the
    embedding is sent under its first name, as ``save_pretrained`` writes it), detached,
    in ``dtype`` when given (floating tensors only)."""
    seen: set[int] = set()  # storage address + offset of each tensor sent
    out = []
    for name, tensor in state.items():
        key = (
            int(tensor.untyped_storage().data_ptr())
            + int(tensor.storage_offset()) * tensor.itemsize
        )
        if key in seen and tensor.numel():
            continue
        seen.add(key)
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out.append((name, tensor))
    return out


def specs_of(named: Sequence[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in named]


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Consecutive runs of ``specs`` (indices) of at most ``bucket_bytes`` each (a tensor
    larger than that is a bucket of its own). A tensor whose byte offset would not be a
    multiple of its item size starts a new bucket, as the receiver requires."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, spec in enumerate(specs):
        item = dtype_of(spec.dtype).itemsize
        if current and (size + spec.nbytes > bucket_bytes or size % item):
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The raw bytes of ``tensors`` concatenated (one ``uint8`` tensor on their device)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def empty_bucket(
    specs: Sequence[TensorSpec], device: torch.device | str, *, shared_memory: bool = False
) -> torch.Tensor:
    """A buffer for the bucket ``specs`` describe; with ``shared_memory`` (a CPU) one
    allocated in a named shared-memory segment (see ``shared``), with no copy."""
    size = sum(s.nbytes for s in specs)
    if shared_memory and torch.device(device).type == "cpu":
        import torch.multiprocessing as mp

        mp.set_sharing_strategy("file_system")
        storage = torch.UntypedStorage._new_shared(size)
        return torch.empty(0, dtype=torch.uint8).set_(storage)
    return torch.empty(size, dtype=torch.uint8, device=device)


def check_alignment(specs: Sequence[TensorSpec]) -> None:
    """WeightTransferError unless every tensor of a flattened bucket starts at a byte
    offset that is a multiple of its item size (what ``unflatten`` needs)."""
    offset = 0
    for spec in specs:
        if offset % dtype_of(spec.dtype).itemsize:
            raise WeightTransferError(
                f"tensor {spec.name} starts at byte {offset} of its bucket, not a "
                f"multiple of {spec.dtype}'s size: split the bucket there"
            )
        offset += spec.nbytes


def unflatten(flat: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` as the tensors ``specs`` describe (the inverse of ``flatten``)."""
    out = []
    offset = 0
    for spec in specs:
        dtype = dtype_of(spec.dtype)
        if offset % dtype.itemsize:
            raise WeightTransferError(
                f"tensor {spec.name} starts at byte {offset}, not a multiple of {dtype}'s size"
            )
        size = spec.nbytes
        if offset + size > flat.numel():
            raise WeightTransferError(
                f"bucket holds {flat.numel()} bytes, too few for tensor {spec.name} at {offset}"
            )
        out.append((spec.name, flat[offset : offset + size].view(dtype).reshape(spec.shape)))
        offset += size
    if offset != flat.numel():
        raise WeightTransferError(f"bucket holds {flat.numel()} bytes, its tensors {offset}")
    return out


# ------------------------------------------------------------ process group


class WeightGroup:
    """A process group for weight broadcasts from rank 0, made without torch's default
    group. Rank 0 hosts the rendezvous (``master_port`` 0 picks a free port: read
    ``port``); ``connect`` blocks until all ``world_size`` ranks have joined or
    ``timeout_s`` passes. Every collective ends within ``timeout_s`` too."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = 60.0,
    ) -> None:
        import torch.distributed as dist

        if world_size < 2 or not 0 <= rank < world_size:
            raise WeightTransferError(
                f"rank {rank} of world size {world_size}: a weight group needs world_size >= 2 "
                "and 0 <= rank < world_size"
            )
        if backend not in ("gloo", "nccl"):
            raise WeightTransferError(f"backend {backend!r} is not gloo or nccl")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.group_name, self.timeout_s = group_name, timeout_s
        self._pg: Any = None
        try:
            self._store = dist.TCPStore(
                master_address,
                int(master_port),
                world_size,
                rank == 0,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except Exception as exc:  # torch raises RuntimeError/DistStoreError/DistNetworkError
            raise WeightTransferError(
                f"weight group {group_name!r}: rank {rank} cannot reach the rendezvous at "
                f"{master_address}:{master_port}: {first_line(exc)}"
            ) from exc
        self.address = master_address
        self.port = int(self._store.port)

    def connect(self) -> WeightGroup:
        """Form the group (every rank calls it); WeightTransferError naming the cause when
        it does not form within the deadline (a rank missing, a wrong world size)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        prefixed = dist.PrefixStore(self.group_name, self._store)
        try:
            if self.backend == "gloo":
                self._pg = dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, timeout)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.world_size, options)
        except Exception as exc:
            raise WeightTransferError(
                f"weight group {self.group_name!r} did not form at {self.address}:{self.port} "
                f"(rank {self.rank} of {self.world_size}, {self.backend}) within "
                f"{self.timeout_s:g} s: {first_line(exc)}"
            ) from exc
        return self

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 (every rank calls it; the others receive into
        it). Raises WeightTransferError when a peer fails or the deadline passes."""
        import torch.distributed as dist

        if self._pg is None:
            raise WeightTransferError(f"weight group {self.group_name!r} is not connected")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            work = self._pg.broadcast([tensor], options)
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).synchronize()
        except Exception as exc:
            raise WeightTransferError(
                f"broadcast in weight group {self.group_name!r} (rank {self.rank} of "
                f"{self.world_size}) failed: {first_line(exc)}"
            ) from exc

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "abort"):
            # A group whose peers are gone may not abort cleanly.
            with contextlib.suppress(Exception):
                pg.abort()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# ------------------------------------------------------------ shared memory


def shared(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in memory another process can read: a CPU tensor moved to a named
    shared-memory segment (any unrelated process on the host can open it by name, where
    torch's default passes a descriptor over a socket to its own children only); a CUDA
    tensor is shareable as it is (IPC)."""
    if tensor.is_cuda:
        return tensor
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    return tensor.contiguous().share_memory_()


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """Handles to ``named`` (each made by ``shared``) as a ``tensor_handles`` JSON
    document: a few hundred bytes per tensor, valid while the sender keeps the tensors
    alive."""
    if any(not (t.is_cuda or t.is_shared()) for _, t in named):
        raise WeightTransferError("serialize_named_tensors takes tensors made by shared()")
    return encode_handles(named)


def deserialize_named_tensors(
    data: bytes, check: Checker, *, device: torch.device | str = "cpu"
) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` list ``serialize_named_tensors`` made, copied out of the
    sender's memory into this process's (``tensor_handles``); ``check`` vets the specs
    first. WeightTransferError for anything else (including memory that is gone)."""
    try:
        return decode_handles(data, check, device=device)
    except HandleError as exc:
        raise WeightTransferError(f"cannot read the tensors sent: {exc}") from exc
