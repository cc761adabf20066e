"""The torch zip writer (`zerosafe.training_state.torch_save`): what it writes, torch reads with
`torch.load(weights_only=True)`, Python's `zipfile` checks, and zerosafe's own restricted reader
reads back, in the plain and the ZIP64 layouts, streamed in chunks of any size."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from zerosafe.formats.torch_pickle import ALLOWED_GLOBALS, InertObject, RestrictedUnpickler
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import Storage
from zerosafe.training_state.torch_save import TensorOut, TorchZipWriter, pickle_bytes


def _write(path: Path, obj: object, storages: dict[str, bytes], *, zip64: bool, chunk: int) -> None:
    sink = Storage().open_sink(str(path))
    writer = TorchZipWriter(sink=sink, archive=path.stem, zip64=zip64)
    writer.add_preamble(pickle_bytes(obj))
    for key, data in storages.items():
        writer.begin(f"data/{key}", size_bytes=len(data))
        for i in range(0, len(data), chunk):
            writer.write(data[i : i + chunk])
        writer.end()
    writer.close()
    sink.commit()


@pytest.mark.parametrize("zip64", [False, True], ids=["zip32", "zip64"])
@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_tensor_dict_round_trips(tmp_path: Path, zip64: bool, chunk: int) -> None:
    """A universal `fp32.pt` of ZeRO-1/2 (`{'cat_dim': 0, 'param': tensor}`) and a 0-dim step."""
    weights = torch.randn(5, 3, dtype=torch.float32)
    step = torch.tensor(7.0)
    obj = {
        "cat_dim": 0,
        "param": TensorOut(key="0", dtype="float32", shape=(5, 3), requires_grad=True),
        "step": TensorOut(key="1", dtype="float32", shape=()),
    }
    path = tmp_path / "fp32.pt"
    storages = {"0": weights.numpy().tobytes(), "1": step.numpy().tobytes()}
    _write(path, obj, storages, zip64=zip64, chunk=chunk)

    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == ["cat_dim", "param", "step"]
    assert loaded["cat_dim"] == 0
    assert torch.equal(loaded["param"], weights) and loaded["param"].requires_grad
    assert torch.equal(loaded["step"], step) and not loaded["step"].requires_grad
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        for info in zf.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            assert info.flag_bits & 0x08  # data descriptor, as torch writes
    zf2 = TorchZipFile(Storage().open_source(str(path)))
    record = zf2.storage_record("0")
    assert zf2.data_offset(record) % 64 == 0
    assert zf2.read_record(record) == storages["0"]  # checks the CRC-32
    if zip64:
        raw = path.read_bytes()
        assert b"PK\x06\x06" in raw and b"PK\x06\x07" in raw


def test_bare_tensor_and_empty(tmp_path: Path) -> None:
    """ZeRO-3's bare flat tensor, and a zero-element one."""
    flat = torch.arange(11, dtype=torch.float32)
    path = tmp_path / "exp_avg.pt"
    _write(
        path, TensorOut(key="0", dtype="float32", shape=(11,)), {"0": flat.numpy().tobytes()},
        zip64=False, chunk=8,
    )  # fmt: skip
    assert torch.equal(torch.load(path, weights_only=True), flat)
    empty = tmp_path / "empty.pt"
    _write(
        empty, {"param": TensorOut(key="0", dtype="float32", shape=(0, 4))}, {"0": b""},
        zip64=False, chunk=8,
    )  # fmt: skip
    assert torch.load(empty, weights_only=True)["param"].shape == (0, 4)


def test_inert_objects_are_written_back_as_their_globals() -> None:
    """DeepSpeed's loss scaler (NEWOBJ + BUILD state) and ZeroStageEnum (REDUCE with its value)
    come back from the restricted reader as they went in, named by their DeepSpeed globals."""
    scaler_cls = ALLOWED_GLOBALS["deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"]
    enum_cls = ALLOWED_GLOBALS["deepspeed.runtime.zero.config.ZeroStageEnum"]
    scaler = scaler_cls()
    scaler.__setstate__({"cur_scale": 4096.0, "dynamic": True, "cur_iter": 3})
    obj = {"loss_scaler": scaler, "zero_stage": enum_cls(2), "pair": (1, 2.5), "name": "x"}
    data = pickle_bytes(obj)
    assert b"deepspeed.runtime.fp16.loss_scaler\nDynamicLossScaler\n" in data
    back = RestrictedUnpickler(data, "mem").load()
    assert isinstance(back["loss_scaler"], InertObject)
    assert back["loss_scaler"].state == {"cur_scale": 4096.0, "dynamic": True, "cur_iter": 3}
    assert back["zero_stage"].value == 2 and back["zero_stage"].state is None
    assert back["pair"] == (1, 2.5) and back["name"] == "x"


def test_zip64_end_records_point_at_the_directory(tmp_path: Path) -> None:
    """The ZIP64 end record names the central directory's real offset (APPNOTE 4.3.14)."""
    path = tmp_path / "z.pt"
    _write(path, TensorOut(key="0", dtype="float32", shape=(3,)), {"0": np.zeros(3, np.float32).tobytes()}, zip64=True, chunk=4)  # fmt: skip
    raw = path.read_bytes()
    at = raw.rindex(b"PK\x06\x06")
    count, cd_size, cd_start = struct.unpack("<QQQ", raw[at + 32 : at + 56])
    assert raw[cd_start : cd_start + 4] == b"PK\x01\x02"
    assert count == len(zipfile.ZipFile(io.BytesIO(raw)).infolist())
    assert at == cd_start + cd_size
