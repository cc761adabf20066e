"""The streaming safetensors writer: golden header bytes, and the reference reader agrees."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from zerosafe.formats.safetensors import HeaderEntry, SafetensorsStreamWriter, build_header
from zerosafe.io.storage import Storage

EDGE_TENSORS = {
    "f32": torch.randn(3, 4),
    "bf16": torch.randn(5).to(torch.bfloat16),
    "f16": torch.randn(2, 3).half(),
    "i64": torch.arange(6) * 1000003,
    "bool": torch.tensor([True, False]),
    "scalar": torch.tensor(2.5),
    "empty": torch.empty(0, 7),
    "u8": torch.arange(3, dtype=torch.uint8),
}


def test_golden_header_bytes() -> None:
    header = build_header(
        [HeaderEntry("a", "float32", (2,)), HeaderEntry("b", "bfloat16", ())],
        {"format": "pt"},
    )
    body = b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[],"data_offsets":[8,10]}}'
    body += b" " * ((8 - (8 + len(body)) % 8) % 8)
    assert header == struct.pack("<Q", len(body)) + body
    assert len(header) % 8 == 0


def _write(
    path: Path, tensors: dict[str, torch.Tensor], *, pieces: int = 3
) -> SafetensorsStreamWriter:
    entries = [
        HeaderEntry(k, str(v.dtype).removeprefix("torch."), tuple(v.shape))
        for k, v in tensors.items()
    ]
    writer = SafetensorsStreamWriter(Storage().open_sink(str(path)), entries, {"format": "pt"})
    for i, t in enumerate(tensors.values()):
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        step = max(1, len(raw) // pieces)
        for start in range(0, len(raw), step):
            writer.write(i, raw[start : start + step])
    writer.finish()
    return writer


def test_streamed_file_reads_back_with_the_reference_library(tmp_path: Path) -> None:
    path = tmp_path / "edge.safetensors"
    writer = _write(path, EDGE_TENSORS)
    back = load_file(str(path))
    assert list(back) and set(back) == set(EDGE_TENSORS)
    for k, v in EDGE_TENSORS.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k], v), k
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert path.stat().st_size == writer.file_bytes


def test_same_tensor_bytes_as_the_reference_writer(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    _write(ours, EDGE_TENSORS)
    save_file(EDGE_TENSORS, str(theirs), metadata={"format": "pt"})
    a, b = load_file(str(ours)), load_file(str(theirs))
    for k in EDGE_TENSORS:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert (
            a[k].reshape(-1).view(torch.uint8).tolist()
            == b[k].reshape(-1).view(torch.uint8).tolist()
        ), k


def test_no_file_appears_until_finish_and_abort_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    writer = SafetensorsStreamWriter(
        Storage().open_sink(str(path)), [HeaderEntry("a", "float32", (4,))]
    )
    writer.write(0, b"\x00" * 8)
    assert not path.exists()
    writer.abort()
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_refuses_short_tensor_at_finish(tmp_path: Path) -> None:
    writer = SafetensorsStreamWriter(
        Storage().open_sink(str(tmp_path / "x.safetensors")), [HeaderEntry("a", "float32", (4,))]
    )
    writer.write(0, b"\x00" * 8)
    with pytest.raises(AssertionError, match="incomplete"):
        writer.finish()
    writer.abort()


def test_header_json_is_valid_and_ordered(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    _write(path, {"z": torch.ones(2), "a": torch.zeros(3)})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert header["z"]["data_offsets"] == [0, 8] and header["a"]["data_offsets"] == [8, 20]
