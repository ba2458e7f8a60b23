"""Handles to tensors in another process's memory, as a small JSON document: what
``/update_weights_from_tensor`` carries from a trainer's sender to a server of its host.

Why not torch's pickled reductions: unpickling calls whatever the bytes name, and even an
allow-list of torch's own rebuild functions lets a refused body set class attributes on
torch's storage classes (``BUILD``), map or grow any shared-memory segment by name
(``rebuild_storage_filename`` truncates a file up to the size it is told) and import
modules by dtype name. A handle here is data only: names, dtypes, shapes, strides, and
for each storage either a shared-memory segment name or a CUDA IPC handle. Nothing is
called, imported or allocated until every field has been checked against this grammar
and against the served architecture (``weight_specs``).

Every tensor arrives as the receiver's own copy:

- **CPU** (torch's ``file_system`` sharing): the segment is opened read-only by name under
  ``/dev/shm`` (torch's ``/torch_<pid>_<random>_<counter>`` form only, no symlink) and its
  bytes read into memory the receiver allocated. The segment is never mapped, so a
  sender that truncates or removes it afterwards cannot fault the receiver (a mapping
  dies of SIGBUS); one that truncates it during the read gives a short read, refused.
  Reading takes no reference on the segment: it lives while the sender holds the
  tensors, and goes when the sender lets go, whoever read it.
- **CUDA** (IPC): the storage is opened through torch with exactly the fields torch's own
  reduction sends, cloned at once, and the sender's memory closed again.

Format (UTF-8 JSON): ``{"format": FORMAT, "storages": [...], "tensors": [...]}``; a storage
is ``{"segment": "/torch_1_2_3", "nbytes": n}`` (CPU) or ``{"cuda_device": i,
"handle": b64, "nbytes": n, "offset_bytes": n, "ref_counter": "/torch_...",
"ref_counter_offset": n, "event": b64 | null, "event_sync": bool}``; a tensor is ``{"name",
"dtype", "shape", "stride", "offset", "storage"}`` (offset in elements, storage an index).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import stat
from collections.abc import Callable, Sequence
from typing import Any

import torch

FORMAT = "sluice.tensor_handles/1"
MAX_DOCUMENT_BYTES = 4 << 20
"""A document names tensors, it does not hold them: a few hundred bytes per tensor."""
MAX_TENSORS = 100_000
SHM_DIR = "/dev/shm"
SEGMENT_NAME = re.compile(r"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")
"""torch's ``NewProcessWideShmHandle`` (aten/src/ATen/MapAllocator.cpp): pid, a random
number, a per-process counter."""
SEGMENT_HEADER_BYTES = 64
"""torch's refcounted segments start with a 64-byte header (``map_info_t``, aligned to
``TH_ALLOC_ALIGNMENT``); the storage's bytes follow it."""
MAX_IPC_HANDLE_BYTES = 256
"""A CUDA IPC memory or event handle is 64 bytes; torch may prefix a few."""

Checker = Callable[[Sequence[tuple[str, str, tuple[int, ...]]], int], None]
"""Called with every tensor's (name, dtype, shape) and the document's total storage
bytes before anything is opened: raises to refuse (``weight_specs.check_specs``)."""


class HandleError(ValueError):
    """A handle document that is not this grammar, does not fit, or whose memory is gone.
    The message is one line and never quotes more than a name."""


_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16")
    + ("int8", "uint8", "bool")
}


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _ints(value: Any, what: str, max_len: int = 8) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > max_len or not all(map(_is_int, value)):
        raise HandleError(f"{what} must be a list of at most {max_len} integers >= 0")
    return tuple(value)


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str) or len(value) > MAX_IPC_HANDLE_BYTES * 2:
        raise HandleError(f"{what} must be a base64 string of at most {MAX_IPC_HANDLE_BYTES} bytes")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise HandleError(f"{what} is not base64") from exc


def _fields(item: Any, required: set[str], optional: set[str], what: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise HandleError(f"{what} must be a JSON object")
    missing, unknown = required - item.keys(), item.keys() - required - optional
    if missing or unknown:
        raise HandleError(f"{what} must have exactly the fields {sorted(required | optional)}")
    return item


# ------------------------------------------------------------------ sender


def encode_handles(named: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """The document naming ``named`` (CPU tensors in torch ``file_system`` shared memory,
    or CUDA tensors), valid while the sender keeps the tensors alive. Takes no reference
    on a segment: the receiver copies, it does not map."""
    storages: list[dict[str, Any]] = []
    index_of: dict[tuple[str, int], int] = {}
    tensors = []
    for name, tensor in named:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), int(storage.data_ptr()))
        if key not in index_of:
            index_of[key] = len(storages)
            storages.append(_storage_entry(storage, tensor))
        tensors.append(
            {
                "name": name,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "stride": list(tensor.stride()),
                "offset": int(tensor.storage_offset()),
                "storage": index_of[key],
            }
        )
    document = {"format": FORMAT, "storages": storages, "tensors": tensors}
    return json.dumps(document, separators=(",", ":")).encode()


def _storage_entry(storage: torch.UntypedStorage, tensor: torch.Tensor) -> dict[str, Any]:
    if tensor.is_cuda:
        device, handle, nbytes, offset, ref, ref_offset, event, sync = storage._share_cuda_()
        return {
            "cuda_device": int(device),
            "handle": base64.b64encode(bytes(handle)).decode(),
            "nbytes": int(nbytes),
            "offset_bytes": int(offset),
            "ref_counter": bytes(ref).decode(),
            "ref_counter_offset": int(ref_offset),
            "event": None if event is None else base64.b64encode(bytes(event)).decode(),
            "event_sync": bool(sync),
        }
    if not storage.is_shared():
        raise HandleError("a CPU tensor must be in shared memory (weight_sync.shared)")
    _, segment, nbytes = storage._share_filename_cpu_()
    return {"segment": bytes(segment).decode(), "nbytes": int(nbytes)}


# ------------------------------------------------------------------ receiver


def decode_handles(
    data: bytes, check: Checker, *, device: torch.device | str = "cpu"
) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs a document names, each a copy the caller owns.
    ``check`` sees every spec before any memory is opened or allocated. HandleError for
    anything else: a body in another form (torch's pickles included), a field outside
    the grammar, a tensor that does not lie inside its storage, memory that is gone."""
    if data[:1] == b"\x80":
        raise HandleError(
            "tensor handles in torch's pickle form are refused: the sender must send "
            f"{FORMAT} JSON handles"
        )
    if len(data) > MAX_DOCUMENT_BYTES:
        raise HandleError(f"the handle document holds {len(data)} bytes, over {MAX_DOCUMENT_BYTES}")
    try:
        document = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HandleError(f"the tensor handles are not a {FORMAT} JSON document") from exc
    document = _fields(document, {"format", "storages", "tensors"}, set(), "the handle document")
    if document["format"] != FORMAT:
        raise HandleError(f"the handle document's format must be {FORMAT!r}")
    storages = [_parse_storage(s, i) for i, s in enumerate(_list(document["storages"]))]
    tensors = [_parse_tensor(t, i, storages) for i, t in enumerate(_list(document["tensors"]))]
    if not tensors:
        raise HandleError("the handle document names no tensors: an update needs some")
    check(
        [(t["name"], t["dtype"], t["shape"]) for t in tensors], sum(s["nbytes"] for s in storages)
    )
    used = sorted({t["storage"] for t in tensors})
    buffers = {i: _open_storage(storages[i], device) for i in used}
    out = []
    for t in tensors:
        dtype = _DTYPES[t["dtype"]]
        if t["end"] == 0:
            out.append((t["name"], torch.empty(t["shape"], dtype=dtype)))
            continue
        start = t["offset"] * dtype.itemsize
        span = buffers[t["storage"]][start : t["end"]].view(dtype)
        out.append((t["name"], span.as_strided(t["shape"], t["stride"], span.storage_offset())))
    return out


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list) or len(value) > MAX_TENSORS:
        raise HandleError(f"storages and tensors must be lists of at most {MAX_TENSORS}")
    return value


def _parse_storage(item: Any, index: int) -> dict[str, Any]:
    what = f"storage {index}"
    if isinstance(item, dict) and "segment" in item:
        entry = _fields(item, {"segment", "nbytes"}, set(), what)
        if not isinstance(entry["segment"], str) or not SEGMENT_NAME.fullmatch(entry["segment"]):
            raise HandleError(f"{what}: a segment must be named as torch names one (/torch_...)")
    else:
        keys = {"cuda_device", "handle", "nbytes", "offset_bytes", "ref_counter"}
        entry = _fields(item, keys | {"ref_counter_offset", "event", "event_sync"}, set(), what)
        if not _is_int(entry["cuda_device"]) or entry["cuda_device"] > 1023:
            raise HandleError(f"{what}: cuda_device must be a device index")
        entry["handle"] = _b64(entry["handle"], f"{what}: handle")
        if entry["event"] is not None:
            entry["event"] = _b64(entry["event"], f"{what}: event")
        ref = entry["ref_counter"]
        if not isinstance(ref, str) or not SEGMENT_NAME.fullmatch(ref):
            raise HandleError(f"{what}: ref_counter must be named as torch names one (/torch_...)")
        for key in ("offset_bytes", "ref_counter_offset"):
            if not _is_int(entry[key]):
                raise HandleError(f"{what}: {key} must be an integer >= 0")
        if not isinstance(entry["event_sync"], bool):
            raise HandleError(f"{what}: event_sync must be a boolean")
    if not _is_int(entry["nbytes"], 1):
        raise HandleError(f"{what}: nbytes must be an integer >= 1")
    return entry


def _parse_tensor(item: Any, index: int, storages: list[dict[str, Any]]) -> dict[str, Any]:
    keys = {"name", "dtype", "shape", "stride", "offset", "storage"}
    entry = _fields(item, keys, set(), f"tensor {index}")
    name = entry["name"]
    if not isinstance(name, str) or not 0 < len(name) <= 512:
        raise HandleError(f"tensor {index}: name must be a string of 1 to 512 characters")
    if not isinstance(entry["dtype"], str) or entry["dtype"] not in _DTYPES:
        raise HandleError(f"tensor {name}: dtype must be one of {', '.join(_DTYPES)}")
    shape, stride = (
        _ints(entry["shape"], f"tensor {name}: shape"),
        _ints(entry["stride"], f"tensor {name}: stride"),
    )
    if len(shape) != len(stride) or not _is_int(entry["offset"]):
        raise HandleError(f"tensor {name}: shape and stride must be as long, offset >= 0")
    if not _is_int(entry["storage"]) or entry["storage"] >= len(storages):
        raise HandleError(f"tensor {name}: storage must index the document's storages")
    itemsize = _DTYPES[entry["dtype"]].itemsize
    # One past the last byte the strided view reaches: it must lie inside its storage.
    end = 0
    if 0 not in shape:
        last = entry["offset"] + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))
        end = (last + 1) * itemsize
    if end > storages[entry["storage"]]["nbytes"]:
        raise HandleError(f"tensor {name}: its view does not lie inside its storage")
    return {**entry, "shape": shape, "stride": stride, "end": end}


def _open_storage(entry: dict[str, Any], device: torch.device | str) -> torch.Tensor:
    """The storage's bytes as a ``uint8`` tensor the caller owns."""
    if "segment" in entry:
        return read_segment(entry["segment"], entry["nbytes"])
    return _copy_cuda(entry, device)


def read_segment(segment: str, nbytes: int) -> torch.Tensor:
    """Segment ``segment``'s ``nbytes`` storage bytes, read (never mapped) into a new
    tensor. HandleError when it is gone, not a regular file, or not that size."""
    path = SHM_DIR + segment
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise HandleError(
            f"shared-memory segment {segment} cannot be opened: {exc.strerror}"
        ) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != SEGMENT_HEADER_BYTES + nbytes:
            raise HandleError(f"shared-memory segment {segment} is not a storage of {nbytes} bytes")
        out = torch.empty(nbytes, dtype=torch.uint8)
        view = out.numpy().data.cast("B")
        done = 0
        while done < nbytes:
            count = os.preadv(fd, [view[done:]], SEGMENT_HEADER_BYTES + done)
            if count <= 0:
                raise HandleError(
                    f"shared-memory segment {segment} ended after {done} of {nbytes} bytes"
                )
            done += count
        return out
    finally:
        os.close(fd)


def _copy_cuda(entry: dict[str, Any], device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type != "cuda":
        raise HandleError("CUDA IPC handles need a GPU server; this one runs on the CPU")
    torch.cuda._lazy_init()
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            entry["cuda_device"], entry["handle"], entry["nbytes"], entry["offset_bytes"],
            entry["ref_counter"].encode(), entry["ref_counter_offset"], entry["event"],
            entry["event_sync"],
        )  # fmt: skip
    except RuntimeError as exc:
        raise HandleError(f"a CUDA IPC handle cannot be opened: {str(exc)[:200]}") from exc
    sender = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    copy = sender.clone()
    torch.cuda.current_stream(copy.device).synchronize()
    del sender, storage  # closes the sender's memory and gives its reference back
    return copy
