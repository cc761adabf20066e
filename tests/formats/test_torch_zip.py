"""The lazy torch-zip reader: real `torch.save` files, refusal of code and of bad files."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from zerosafe.errors import CheckpointFormatError, IntegrityError, UnsafePickleError
from zerosafe.formats.torch_zip import InertObject, TensorRecord, TorchZipFile
from zerosafe.io.storage import IOCounter, Storage


def _open(path: Path, counter: IOCounter | None = None) -> TorchZipFile:
    return TorchZipFile(Storage(counter=counter).open_source(str(path)))


def _tensor_from(zf: TorchZipFile, rec: TensorRecord, like: torch.Tensor) -> torch.Tensor:
    raw = zf.read_tensor_bytes(rec)
    return (
        torch.frombuffer(bytearray(raw), dtype=like.dtype).reshape(like.shape)
        if raw
        else torch.empty(like.shape, dtype=like.dtype)
    )


def test_reads_tensors_of_every_dtype_views_and_params(tmp_path: Path) -> None:
    base = torch.arange(40, dtype=torch.float32)
    obj = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(5) * 1000003,
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "view": base[10:20].view(2, 5),
        "transposed": torch.randn(4, 6).t(),
        "param": torch.nn.Parameter(torch.randn(3)),
        "nested": [OrderedDict(a=torch.ones(2)), (1, "x", None, 2.5)],
        7: "integer key",
    }
    path = tmp_path / "x.pt"
    torch.save(obj, path)
    zf = _open(path)
    got = zf.load()
    assert got[7] == "integer key"
    assert got["nested"][1] == (1, "x", None, 2.5)
    for key in (
        "f32",
        "bf16",
        "f16",
        "i64",
        "bool",
        "scalar",
        "empty",
        "view",
        "transposed",
        "param",
    ):
        want = obj[key].detach()
        rec = got[key]
        assert isinstance(rec, TensorRecord)
        assert rec.shape == tuple(want.shape)
        assert torch.equal(_tensor_from(zf, rec, want), want), key
    assert got["view"].storage_offset == 10 and got["view"].storage.numel == 40
    assert not got["transposed"].is_contiguous()


def test_reads_nothing_but_the_directory_and_pickle(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(2_000_000)}, path)  # 8 MB of data
    counter = IOCounter()
    zf = _open(path, counter)
    zf.load()
    assert counter.bytes_read < 100_000, counter


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))

    marker = ""


def test_refuses_a_pickle_that_would_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _Evil.marker = str(marker)
    path = tmp_path / "evil.pt"
    torch.save({"optimizer_state_dict": {"x": _Evil()}}, path)
    with pytest.raises(
        UnsafePickleError, match=r"'posix\.system'.*not on zerosafe's allowlist"
    ) as e:
        _open(path).load()
    assert str(path) in str(e.value)
    assert not marker.exists(), "the pickle ran code"


def test_refuses_unknown_global_even_if_harmless(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"when": __import__("datetime").date(2020, 1, 1)}, path)
    with pytest.raises(UnsafePickleError, match="datetime.date"):
        _open(path).load()


def test_deepspeed_bookkeeping_objects_become_inert(tmp_path: Path) -> None:
    # A hand-written protocol-2 pickle naming DeepSpeed's classes, as real files do.
    class Writer(pickle.Pickler):
        pass

    data = (
        b"\x80\x02}q\x00(X\x0a\x00\x00\x00zero_stagecdeepspeed.runtime.zero.config\nZeroStageEnum\nK\x03\x85R"
        b"X\x06\x00\x00\x00scalercdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n)\x81}X\x09\x00\x00\x00cur_scaleG?\xf0\x00\x00\x00\x00\x00\x00sbu."
    )
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", data)
        z.writestr("archive/byteorder", "little")
    path = tmp_path / "ds.pt"
    path.write_bytes(buf.getvalue())
    got = _open(path).load()
    assert isinstance(got["zero_stage"], InertObject) and got["zero_stage"].value == 3
    assert got["scaler"].get("cur_scale") == 1.0


def test_refuses_legacy_format_with_resave_hint(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointFormatError, match="legacy .*torch.save\\(torch.load"):
        _open(path)


def test_refuses_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.randn(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError, match="truncated"):
        _open(path)


def test_refuses_file_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(b"hello world, not a checkpoint" * 10)
    with pytest.raises(CheckpointFormatError, match="not a torch checkpoint"):
        _open(path)


def test_crc_of_a_flipped_bit_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.arange(100, dtype=torch.float32)}, path)
    zf = _open(path)
    rec = zf.load()["w"]
    record = zf.storage_record(rec.storage.key)
    offset = zf.data_offset(record)
    raw = bytearray(path.read_bytes())
    raw[offset + 17] ^= 0x10
    path.write_bytes(bytes(raw))
    zf = _open(path)
    zf.load()
    with pytest.raises(IntegrityError, match="CRC32"):
        zf.read_record(zf.storage_record(rec.storage.key))


def test_zip64_file_from_python_zipfile(tmp_path: Path) -> None:
    # zipfile writes ZIP64 records when forced; the reader must follow them.
    path = tmp_path / "z64.pt"
    src = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(10, dtype=torch.int64)}, src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            with zout.open(info.filename, "w", force_zip64=True) as f:
                f.write(zin.read(info.filename))
    zf = _open(path)
    rec = zf.load()["w"]
    assert np.frombuffer(zf.read_tensor_bytes(rec), dtype=np.int64).tolist() == list(range(10))


def test_pickle_cannot_make_the_reader_allocate(tmp_path: Path) -> None:
    # `bytearray(2**40)` is a one-line pickle; the reader must not honour it.
    payload = b"\x80\x02cbuiltins\nbytearray\n\x8a\x06\x00\x00\x00\x00\x00\x01\x85R."
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
    path = tmp_path / "alloc.pt"
    path.write_bytes(buf.getvalue())
    with pytest.raises(UnsafePickleError, match=r"bytearray\(int\) is not allowed"):
        _open(path).load()
