"""Files torch.save never writes (crafted or corrupted pickles): pt2st refuses each one before
writing anything, with one line naming the tensor, instead of writing a file that loads as
something else or fails to load. Also: the output may never be the input, however spelled."""

from __future__ import annotations

import argparse
import collections
import math
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.pt2st.helpers import CraftedStorage, Rebuild, craft_pt, write_torch_zip
from zerosafe.errors import CheckpointFormatError
from zerosafe.pt2st import convert_pt, inspect_pt, load_pt_like
from zerosafe_app.cli import main

_FLOATS = CraftedStorage("0", torch.FloatStorage, 10, bytes(40))
_LONGS = CraftedStorage("1", torch.LongStorage, 2, bytes(16))
_HOOKS = collections.OrderedDict()


def _t(storage: CraftedStorage, offset: Any, shape: Any, stride: Any, grad: bool = False):
    return Rebuild(storage, offset, shape, stride, grad, _HOOKS)


BAD_RECORDS = {
    "negative size": (_t(_FLOATS, 0, (-2, 5), (5, 1)), "shape \\[-2, 5\\]"),
    "view past its storage": (_t(_FLOATS, 5, (10,), (1,)), "reaches byte 60 .* holds 40 bytes"),
    "negative stride": (_t(_FLOATS, 9, (3,), (-1,)), "strides \\[-1\\]"),
    "negative offset": (_t(_FLOATS, -1, (2,), (1,)), "offset -1"),
    "strides do not match dims": (_t(_FLOATS, 0, (2, 5), (1,)), "one per dimension"),
    "empty view offset past storage": (_t(_FLOATS, 11, (0,), (1,)), "reaches byte 44"),
    "stride 0 with 2**126 elements": (_t(_FLOATS, 0, (2**63 - 1, 2**63 - 1), (0, 0)), "2\\*\\*63"),
    "huge size": (_t(_FLOATS, 0, (2**64,), (1,)), "2\\*\\*63"),
    "float size": (_t(_FLOATS, 0, (2.5,), (1,)), "size is float 2.5, expected an int"),
    "requires_grad on int64": (_t(_LONGS, 0, (2,), (1,), True), "int64 with requires_grad"),
    "storage is not a storage": (Rebuild(("x", "y"), 0, (1,), (1,), False, _HOOKS), "str 'x'"),
}


@pytest.mark.parametrize("case", BAD_RECORDS, ids=list(BAD_RECORDS))
def test_bad_tensor_record_is_refused_before_writing(tmp_path: Path, case: str) -> None:
    record, match = BAD_RECORDS[case]
    pt = craft_pt(tmp_path / "x.pt", {"ok": _t(_FLOATS, 0, (10,), (1,)), "w": record},
                  [_FLOATS, _LONGS])  # fmt: skip
    with pytest.raises(CheckpointFormatError, match=match):
        inspect_pt(str(pt))
    with pytest.raises(CheckpointFormatError, match=match):
        convert_pt(str(pt), str(tmp_path / "x.safetensors"))
    assert os.listdir(tmp_path) == ["x.pt"]  # no output, no temporary file


def test_storage_with_negative_or_conflicting_size_is_refused(tmp_path: Path) -> None:
    neg = CraftedStorage("0", torch.FloatStorage, -4, bytes(16))
    pt = craft_pt(tmp_path / "n.pt", {"w": _t(neg, 0, (0,), (1,))}, [neg])
    with pytest.raises(CheckpointFormatError, match="storage '0' has -4 elements"):
        convert_pt(str(pt), str(tmp_path / "n.safetensors"))
    small = CraftedStorage("0", torch.FloatStorage, 2, bytes(40))
    pt = craft_pt(tmp_path / "c.pt", {"a": _t(small, 0, (2,), (1,)),
                                      "b": _t(_FLOATS, 0, (10,), (1,))}, [_FLOATS])  # fmt: skip
    with pytest.raises(CheckpointFormatError, match="named twice"):
        convert_pt(str(pt), str(tmp_path / "c.safetensors"))
    assert sorted(os.listdir(tmp_path)) == ["c.pt", "n.pt"]


class _Reduce:
    def __init__(self, func: Any, args: tuple[Any, ...], state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args, self.state)


def _numpy_array(shape: tuple[int, ...], raw: bytes) -> _Reduce:
    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]  # numpy's own `_reconstruct`
    return _Reduce(reconstruct, (np.ndarray, (0,), b"b"), (1, shape, np.dtype("f4"), False, raw))


def _namespace_with_int_key() -> argparse.Namespace:
    ns = argparse.Namespace(lr=0.1)
    vars(ns)[1] = 2
    return ns


def _odict_with_class_attr() -> collections.OrderedDict:
    od: collections.OrderedDict = collections.OrderedDict(a=1)
    vars(od)["__class__"] = 5
    return od


BAD_VALUES = {
    "numpy data shorter than its shape": (_numpy_array((3,), bytes(4)), "has 4 bytes"),
    "numpy negative shape": (_numpy_array((-1,), b""), "shape \\[-1\\]"),
    "Namespace with an int key": (_namespace_with_int_key(), "argparse.Namespace"),
    "OrderedDict attribute __class__": (_odict_with_class_attr(), "__class__"),
    "torch.Size of strings": (_Reduce(torch.Size, (["a"],)), "torch.Size"),
}


@pytest.mark.parametrize("case", BAD_VALUES, ids=list(BAD_VALUES))
def test_value_that_would_not_load_back_is_refused(tmp_path: Path, case: str) -> None:
    value, match = BAD_VALUES[case]
    pt = tmp_path / "v.pt"
    torch.save({"w": torch.ones(2), "v": value}, pt)
    with pytest.raises(CheckpointFormatError, match=match):
        convert_pt(str(pt), str(tmp_path / "v.safetensors"))
    assert os.listdir(tmp_path) == ["v.pt"]


def test_keys_that_encode_alike_are_refused(tmp_path: Path) -> None:
    pt = tmp_path / "nan.pt"
    torch.save({float("nan"): torch.ones(2), float("nan"): torch.zeros(2)}, pt)
    with pytest.raises(CheckpointFormatError, match="same entry name"):
        convert_pt(str(pt), str(tmp_path / "nan.safetensors"))
    assert os.listdir(tmp_path) == ["nan.pt"]


def test_deep_nesting_is_one_line_not_a_traceback(tmp_path: Path, capsys) -> None:
    depth = 100_000  # built by opcodes: torch.save itself would hit the recursion limit
    data = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."
    assert pickle.loads(data) is not None
    pt = write_torch_zip(tmp_path / "deep.pt", data, {})
    assert main(["pt2st", str(pt)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nested too deeply" in err
    assert os.listdir(tmp_path) == ["deep.pt"]


def test_valid_crafted_views_still_convert(tmp_path: Path) -> None:
    # The edges that must stay allowed: an empty view at the storage's end, a stride-0
    # (expanded) view, an exact fit.
    pt = craft_pt(tmp_path / "ok.pt", {
        "end": _t(_FLOATS, 10, (0,), (1,)),
        "expanded": _t(_FLOATS, 9, (1000, 3), (0, 0)),
        "whole": _t(_FLOATS, 0, (2, 5), (5, 1)),
    }, [_FLOATS])  # fmt: skip
    out = tmp_path / "ok.safetensors"
    convert_pt(str(pt), str(out))
    got = load_pt_like(str(out))
    assert got["expanded"].shape == (1000, 3) and got["end"].numel() == 0
    assert math.prod(got["whole"].shape) == 10


def _same_file_spellings(tmp_path: Path) -> list[list[str]]:
    pt = tmp_path / "x.pt"
    os.symlink(pt, tmp_path / "link.pt")
    os.link(pt, tmp_path / "hard.pt")
    rel = os.path.relpath(pt)
    return [
        [str(pt), str(pt)],
        [rel, "./" + rel],
        [str(pt), f"file://{pt}"],
        [str(pt), str(tmp_path / "sub" / ".." / "x.pt")],
        [str(pt), str(tmp_path / "link.pt")],
        [str(pt), str(tmp_path / "hard.pt")],
    ]


def test_output_that_is_the_input_is_refused(tmp_path: Path, capsys) -> None:
    pt = tmp_path / "x.pt"
    torch.save({"w": torch.arange(4.0)}, pt)
    before = pt.read_bytes()
    (tmp_path / "sub").mkdir()
    for source, output in _same_file_spellings(tmp_path):
        assert main(["pt2st", source, output, "--overwrite"]) == 2, (source, output)
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "is the input file" in err, err
        assert pt.read_bytes() == before and os.path.islink(tmp_path / "link.pt")
    assert sorted(os.listdir(tmp_path)) == ["hard.pt", "link.pt", "sub", "x.pt"]


def test_folder_as_input_or_output_is_one_line(tmp_path: Path, capsys) -> None:
    pt = tmp_path / "x.pt"
    torch.save({"w": torch.arange(4.0)}, pt)
    assert main(["pt2st", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["pt2st", str(pt), str(tmp_path)]) == 2
    assert "x.safetensors" in capsys.readouterr().err
    assert main(["pt2st", str(tmp_path / "missing.pt")]) == 2
    assert "file not found" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["x.pt"]
