"""Legacy (non-zip) torch files: read lazily, without running code, every storage located."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from zerosafe.errors import CheckpointFormatError, UnsafePickleError
from zerosafe.formats.torch_legacy import LegacyTorchFile, open_torch_file
from zerosafe.formats.torch_pickle import TensorRecord
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import Storage


def _open(path: Path) -> TorchZipFile:
    return open_torch_file(Storage().open_source(str(path)))


def _values(f: TorchZipFile, t: TensorRecord) -> torch.Tensor:
    from zerosafe.dtypes import torch_dtype

    raw = bytearray(f.read_tensor_bytes(t))
    if not raw:
        return torch.empty(t.shape, dtype=torch_dtype(t.dtype))
    return torch.frombuffer(raw, dtype=torch_dtype(t.dtype)).reshape(t.shape)


def test_every_tensor_reads_back_as_torch_load_gives_it(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32)
    state = {
        "fp32": base,
        "view": base[3:9],  # shares the storage: an offset into it
        "strided": base.reshape(4, 6)[:, 1],  # gathered from a strided view
        "bf16": torch.linspace(-2, 2, 7).to(torch.bfloat16),
        "fp16": torch.ones(2, 3, dtype=torch.float16),
        "int64": torch.tensor([7, -1, 2**40]),
        "empty": torch.zeros(0, 4),
        "nested": {"list": [torch.full((2,), 3.5)], "step": 12, "name": "x"},
    }
    path = tmp_path / "legacy.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False)
    f = _open(path)
    assert isinstance(f, LegacyTorchFile)
    obj = f.load()
    want = torch.load(path, weights_only=True)
    for key in ("fp32", "view", "strided", "bf16", "fp16", "int64", "empty"):
        assert torch.equal(_values(f, obj[key]), want[key]), key
    assert torch.equal(_values(f, obj["nested"]["list"][0]), want["nested"]["list"][0])
    assert obj["nested"]["step"] == 12 and obj["nested"]["name"] == "x"
    assert obj["view"].storage_offset == 3 and obj["view"].storage == obj["fp32"].storage


def test_a_zip_file_still_opens_with_the_zip_reader(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "z.pt")
    assert type(_open(tmp_path / "z.pt")) is TorchZipFile


def test_pickles_larger_than_the_first_read(tmp_path: Path) -> None:
    state = {f"param.{i}.with.a.long.name.to.grow.the.pickle": torch.ones(1) for i in range(30000)}
    path = tmp_path / "big.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False)
    obj = _open(path).load()
    assert len(obj) == 30000


class _Evil:
    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    _Evil.marker = str(marker)
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Evil()}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafePickleError, match="posix.system|os.system"):
        _open(path)
    assert not marker.exists()


def test_truncated_data_and_a_wrong_count_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save({"w": torch.arange(100.0)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    (tmp_path / "short.pt").write_bytes(data[:-40])
    with pytest.raises(CheckpointFormatError, match="runs past the end of the file"):
        _open(tmp_path / "short.pt")
    (tmp_path / "head.pt").write_bytes(data[:30])
    with pytest.raises(CheckpointFormatError, match="truncated or corrupt"):
        _open(tmp_path / "head.pt")
    count_at = len(data) - 400 - 8  # the one storage: its int64 count, then 400 bytes
    assert int.from_bytes(data[count_at : count_at + 8], "little") == 100
    bad = bytearray(data)
    bad[count_at : count_at + 8] = (99).to_bytes(8, "little")
    (tmp_path / "count.pt").write_bytes(bytes(bad))
    with pytest.raises(CheckpointFormatError, match="holds 99 elements where the pickle names 100"):
        _open(tmp_path / "count.pt")


def test_a_pickle_of_something_else_is_not_taken_for_a_legacy_file(tmp_path: Path) -> None:
    path = tmp_path / "p.pt"
    path.write_bytes(pickle.dumps({"a": np.arange(3).tolist()}, protocol=2))
    with pytest.raises(CheckpointFormatError, match="not a torch checkpoint|legacy"):
        _open(path)
