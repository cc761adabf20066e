"""`read_checked_header` refuses a safetensors header its file does not bear out, as the
`safetensors` library itself does: files written by `safetensors.torch.save_file`, then their
header rewritten."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.hf.headers import read_checked_header
from zerosafe.io.storage import Storage


def _saved(path: Path) -> tuple[dict[str, Any], bytes]:
    save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}, path)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _rewrite(path: Path, header: dict[str, Any], body: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _read(path: Path) -> Any:
    source = Storage().open_source(str(path))
    try:
        return read_checked_header(source)
    finally:
        source.close()


def test_reads_what_save_file_wrote(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _saved(path)
    header = _read(path)
    assert {n: (t.dtype, t.shape, t.nbytes) for n, t in header.tensors.items()} == {
        "a": ("float32", (2, 3), 24),
        "b": ("int64", (4,), 32),
    }
    assert header.size_bytes == path.stat().st_size


def _set(key: str, field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        header[key][field] = value

    return change


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (_set("a", "dtype", "F33"), "dtype 'F33'"),
        (_set("a", "shape", [2, 4]), "needs 32"),
        (_set("a", "shape", [-1, 3]), "expected a list of sizes"),
        (_set("a", "data_offsets", [24, 48]), "overlaps"),
        (lambda h: h.pop("b"), "leaves a hole"),
        (lambda h: h.__setitem__("__metadata__", {"k": 1}), "`__metadata__`"),
        (lambda h: h.__setitem__("c", [1, 2]), "not a safetensors header"),
        (lambda h: h["a"].pop("shape"), "expected dtype, shape, data_offsets"),
    ],
)
def test_refuses_a_header_the_file_does_not_bear_out(
    change: Callable[[dict[str, Any]], None], match: str, tmp_path: Path
) -> None:
    path = tmp_path / "m.safetensors"
    header, body = _saved(path)
    change(header)
    _rewrite(path, header, body)
    with pytest.raises(CheckpointFormatError, match=match):
        _read(path)


def test_refuses_bytes_after_the_data(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    header, body = _saved(path)
    _rewrite(path, header, body + b"\0" * 8)
    with pytest.raises(CheckpointFormatError, match="appended"):
        _read(path)
