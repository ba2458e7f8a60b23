"""Tensor handles (``engines/inference/tensor_handles.py``) as an attacker on the host
writes them: pickles that set class attributes on torch's storages, segment names that
point anywhere or grow a segment, dtype names that import modules, views past their
storage, an empty update. Each is refused in one line before anything is opened,
imported or allocated, and nothing the receiver holds is changed."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.tensor_handles import (
    FORMAT,
    SEGMENT_HEADER_BYTES,
    SHM_DIR,
    HandleError,
    decode_handles,
)
from sluice.engines.inference.types import WeightLoadError
from sluice.engines.inference.weight_specs import SpecMismatch
from sluice.engines.inference.weight_sync import serialize_named_tensors, shared


def _take_all(specs: Any, declared_bytes: int) -> None:
    """A receiver that takes any spec (the served-model check has tests of its own)."""


def _document(segment: str, nbytes: int, **tensor: Any) -> bytes:
    entry = {"name": "w", "dtype": "float32", "shape": [4], "stride": [1], "offset": 0}
    entry.update(tensor, storage=0)
    storages = [{"segment": segment, "nbytes": nbytes}]
    return json.dumps({"format": FORMAT, "storages": storages, "tensors": [entry]}).encode()


def _segment_of(tensor: torch.Tensor) -> str:
    return json.loads(serialize_named_tensors([("w", tensor)]))["storages"][0]["segment"]


def test_a_pickle_that_builds_attributes_on_torchs_storage_classes_is_never_loaded() -> None:
    # GLOBAL torch.storage.UntypedStorage, state (None, {"_new_shared": None}), BUILD:
    # under an allow-list that admits the class, BUILD sets the attribute process-wide
    # and every later shared-memory update fails.
    for cls in ("UntypedStorage", "TypedStorage"):
        data = f"ctorch.storage\n{cls}\n(N(V_new_shared\nNdtb.".encode()
        with pytest.raises(HandleError, match="not a sluice.tensor_handles/1 JSON document"):
            decode_handles(data, _take_all)
    assert callable(torch.UntypedStorage._new_shared)
    tensor = shared(torch.arange(4.0))
    ((_, copy),) = decode_handles(serialize_named_tensors([("w", tensor)]), _take_all)
    assert torch.equal(copy, tensor)


@pytest.mark.parametrize(
    "segment",
    ["/../../etc/passwd", "/sem.victim", "/torch_1_2_3/../x", "torch_1_2_3", "/torch_a_2_3"],
)
def test_a_segment_not_named_as_torch_names_one_is_refused_unopened(segment: str) -> None:
    with pytest.raises(HandleError, match="a segment must be named as torch names one"):
        decode_handles(_document(segment, 16), _take_all)


def test_a_segment_is_never_grown_to_the_size_a_handle_claims() -> None:
    # torch's rebuild_storage_filename maps a segment at the size it is told, growing
    # the file: any /dev/shm segment could be blown up by name.
    tensor = shared(torch.arange(4.0))
    segment = _segment_of(tensor)
    path = SHM_DIR + segment
    size = os.stat(path).st_size
    with pytest.raises(HandleError, match="is not a storage of 1073741824 bytes"):
        decode_handles(_document(segment, 1 << 30), _take_all)
    assert os.stat(path).st_size == size == SEGMENT_HEADER_BYTES + 16


def test_a_view_past_its_storage_is_refused() -> None:
    tensor = shared(torch.arange(4.0))
    data = _document(_segment_of(tensor), 16, offset=1)
    with pytest.raises(HandleError, match="its view does not lie inside its storage"):
        decode_handles(data, _take_all)


def test_a_dtype_name_is_never_looked_up_in_torch() -> None:
    # Before: a dtype name was resolved with getattr(torch, name), so "_dynamo" imported
    # torch._dynamo (seconds, and any side effect an import has) before being refused.
    script = (
        "import sys, json\n"
        "from sluice.engines.inference.tensor_handles import decode_handles, HandleError\n"
        f"data = {_document('/torch_1_2_3', 16, dtype='_dynamo')!r}\n"
        "try:\n    decode_handles(data, lambda s, n: None)\n"
        "except HandleError as exc:\n    print(exc)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[0].startswith("tensor w: dtype must be one of float32")
    assert out[1] == "False"


def test_the_served_architecture_is_checked_before_any_segment_is_opened(
    tiny_dir: Path,
) -> None:
    engine = InferenceEngine(tiny_dir, max_batch_size=1, max_seq_len=16)
    # The segment does not exist: the refusal names the spec, so nothing was opened.
    huge = _document(
        "/torch_1_2_3", 1 << 28, name="lm_head.stolen", shape=[8192, 8192], stride=[8192, 1]
    )
    with pytest.raises(SpecMismatch, match="lm_head.stolen is not a tensor of the served"):
        decode_handles(huge, engine.check_tensor_specs)
    name, target = next(iter(engine.model.state_dict().items()))
    twice = [(name, "float32", tuple(target.shape))] * 2
    with pytest.raises(SpecMismatch, match="twice"):
        engine.check_tensor_specs(twice, 0)
    as_ints = [(name, "int64", tuple(target.shape))]
    with pytest.raises(SpecMismatch, match="not a floating dtype"):
        engine.check_tensor_specs(as_ints, 0)
    with pytest.raises(SpecMismatch, match="more than the served model's"):
        engine.check_tensor_specs([(name, "float32", tuple(target.shape))], 1 << 40)


def test_an_empty_update_is_refused(tiny_dir: Path) -> None:
    empty = json.dumps({"format": FORMAT, "storages": [], "tensors": []}).encode()
    with pytest.raises(HandleError, match="names no tensors"):
        decode_handles(empty, _take_all)
    engine = InferenceEngine(tiny_dir, max_batch_size=1, max_seq_len=16)
    with pytest.raises(WeightLoadError, match="an update needs at least one tensor"):
        engine.update_weights_from_tensors([], 1)
    assert engine.weight_version == 0 and engine.staged_tensors == 0


def test_fields_outside_the_grammar_are_refused_in_one_line() -> None:
    good = json.loads(_document("/torch_1_2_3", 16))
    cases = [
        {**good, "extra": 1},
        {**good, "format": "torch.pickle"},
        {**good, "tensors": [{**good["tensors"][0], "shape": [-1]}]},
        {**good, "tensors": [{**good["tensors"][0], "storage": 5}]},
        {**good, "storages": [{"cuda_device": 0, "handle": base64.b64encode(b"x" * 999).decode()}]},
    ]
    for case in cases:
        with pytest.raises(HandleError) as caught:
            decode_handles(json.dumps(case).encode(), _take_all)
        assert "\n" not in str(caught.value)
