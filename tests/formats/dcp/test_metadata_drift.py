"""DCP `.metadata` written by other torch (and Python) versions than the installed one, and by
OLMo-core's writer (issue 26; open-instruct #1809: a `.metadata` from one torch version fails
to unpickle on another).

Each checkpoint is a real one: `dcp.save` (torch 2.13, one process) writes the `.distcp`
files and the `.metadata`. Where torch 2.13's own classes can write the older form, they do:
`TensorProperties` from `torch.distributed._shard.sharded_tensor.metadata`, patched in as
torch's own BC test `test_sharded_tensor_dependency` does (the form before torch PR #116248).
Where the form is only a missing field, the metadata is pickled from torch's own objects
with that field deleted from the instance, which is exactly what the older class pickles
(torch 2.3 before `StorageMeta`, PR #124772; before `Metadata.version`, PR #155343; before
`StorageMeta.modules`). Python 3.13's `pathlib._local.PosixPath(text)` is written by a
pickler that names that class the way Python 3.13 does (checked against a 3.13 interpreter
when this test was written: `pickle.dumps(PosixPath('/a/b'))` names `pathlib._local` and
passes the whole text). OLMo-core's `_StorageInfo` is OLMo-core's own class, swapped in for
torch's with the same fields, which is what its `RemoteFileSystemWriter.finish` pickles.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from tests.formats.dcp.helpers import assemble, same_bits
from zerosafe.errors import UnsafePickleError, UnsupportedCheckpointError
from zerosafe.formats.base import SourceLayout
from zerosafe.formats.dcp.metadata import parse_metadata
from zerosafe.formats.dcp.reader import read_dcp_layout
from zerosafe.io.storage import Storage


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(5, 3, generator=g),
            "h": torch.randn(4, generator=g).to(torch.bfloat16),
            "n": torch.arange(6, dtype=torch.int64),
        },
        "step": 3,
    }


def _save(path: Path, state: dict[str, Any]) -> Path:
    with pytest.warns(UserWarning):  # no process group: torch warns, then saves in-process
        dcp.save(state, checkpoint_id=str(path))
    return path


def _read(path: Path) -> Metadata:
    # Tests may unpickle with torch's classes: they generate the fixtures.
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f)
    assert isinstance(meta, Metadata)
    return meta


def _write(path: Path, meta: Any, pickler: type[pickle.Pickler] = pickle.Pickler) -> None:
    buf = io.BytesIO()
    pickler(buf).dump(meta)
    (path / ".metadata").write_bytes(buf.getvalue())


def _assert_converts(path: Path, state: dict[str, Any]) -> SourceLayout:
    layout = read_dcp_layout(str(path), Storage())
    want = state["model"]
    assert list(layout.tensors) == list(want)
    for name, tensor in layout.tensors.items():
        assert same_bits(assemble(layout, tensor), want[name]), name
    return layout


def test_torch_2_13_metadata(tmp_path: Path) -> None:
    state = _state()
    path = _save(tmp_path / "ck", state)
    meta = parse_metadata((path / ".metadata").read_bytes(), "m")
    assert meta.version == "1.0.0" and meta.writers == ("torch's FileSystemWriter",)
    _assert_converts(path, state)


def test_sharded_tensor_properties(tmp_path: Path) -> None:
    """The form before DCP had its own `TensorProperties` (torch PR #116248)."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    state = _state()
    with patch("torch.distributed.checkpoint.metadata.TensorProperties", TensorProperties):
        path = _save(tmp_path / "ck", state)
    data = (path / ".metadata").read_bytes()
    assert b"sharded_tensor.metadata" in data and b"MEM_FORMAT_ENCODING" in data
    meta = parse_metadata(data, "m")
    assert "torch.distributed._shard.sharded_tensor.metadata.TensorProperties" in (
        meta.globals_found
    )
    _assert_converts(path, state)


@pytest.mark.parametrize(
    "missing",
    [
        ("storage_meta", "version"),  # torch 2.3: neither field yet
        ("version",),  # torch 2.4 up to PR #155343
    ],
)
def test_metadata_without_newer_fields(tmp_path: Path, missing: tuple[str, ...]) -> None:
    state = _state()
    path = _save(tmp_path / "ck", state)
    meta = _read(path)
    for field in missing:
        del meta.__dict__[field]
    if "storage_meta" not in missing:
        del meta.storage_meta.__dict__["modules"]  # StorageMeta before its `modules`
    _write(path, meta)
    assert parse_metadata((path / ".metadata").read_bytes(), "m").version is None
    _assert_converts(path, state)


class _PosixPath313:
    """Pickles as Python 3.13 pickles a `pathlib.PosixPath`: `pathlib._local.PosixPath(text)`."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __reduce__(self) -> tuple[Any, ...]:
        return (_PosixPath313, (self.text,))


def test_python_3_13_checkpoint_id_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = types.ModuleType("pathlib._local")
    _PosixPath313.__module__, _PosixPath313.__qualname__ = "pathlib._local", "PosixPath"
    local.PosixPath = _PosixPath313  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pathlib._local", local)
    state = _state()
    path = _save(tmp_path / "ck", state)
    meta = _read(path)
    meta.storage_meta.checkpoint_id = _PosixPath313(str(path))
    _write(path, meta)
    assert b"pathlib._local" in (path / ".metadata").read_bytes()
    _assert_converts(path, state)
    # and Python 3.12's form, from the real class
    meta.storage_meta.checkpoint_id = pathlib.PosixPath(path)
    _write(path, meta)
    _assert_converts(path, state)


def _swap_storage_info(meta: Metadata, cls: type, **extra: Any) -> None:
    for key, info in list(meta.storage_data.items()):
        new = cls(info.relative_path, info.offset, info.length)
        new.__dict__.update(extra)
        meta.storage_data[key] = new


def test_olmo_core_storage_info(tmp_path: Path) -> None:
    from olmo_core.distributed.checkpoint.filesystem import _StorageInfo

    state = _state()
    path = _save(tmp_path / "ck", state)
    meta = _read(path)
    _swap_storage_info(meta, _StorageInfo)
    del meta.__dict__["version"]  # RemoteFileSystemWriter.finish sets none
    _write(path, meta)
    parsed = parse_metadata((path / ".metadata").read_bytes(), "m")
    assert parsed.writers == ("OLMo-core's RemoteFileSystemWriter",)
    layout = _assert_converts(path, state)
    assert layout.facts.fields["writers"] == ["OLMo-core's RemoteFileSystemWriter"]


def _refused(path: Path, edit: Callable[[Metadata], None], match: str) -> None:
    meta = _read(path)
    edit(meta)
    _write(path, meta)
    with pytest.raises(UnsupportedCheckpointError, match=match) as e:
        read_dcp_layout(str(path), Storage())
    assert "\n" not in str(e.value)


def test_unknown_storage_info_field_is_refused(tmp_path: Path) -> None:
    """A field a future writer adds (say, a compression) could move the bytes: refused."""
    from olmo_core.distributed.checkpoint.filesystem import _StorageInfo

    path = _save(tmp_path / "ck", _state())
    _refused(
        path,
        lambda meta: _swap_storage_info(meta, _StorageInfo, compression="zstd"),
        r"_StorageInfo of OLMo-core's RemoteFileSystemWriter with field\(s\) \['compression'\]",
    )
    path = _save(tmp_path / "ck2", _state())

    def add_field(meta: Metadata) -> None:
        for info in meta.storage_data.values():
            info.__dict__["byte_order"] = "big"

    _refused(path, add_field, r"torch's FileSystemWriter with field\(s\) \['byte_order'\]")


def test_other_tensor_properties_and_versions_are_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    with patch(
        "torch.distributed.checkpoint.metadata.TensorProperties.__getstate__",
        lambda self: (self.dtype, self.layout, False, None, False, (3, 1)),
    ):
        _refused(path, lambda meta: None, r"TensorProperties of 6 values, expected the 5")
    path = _save(tmp_path / "ck2", _state())
    _refused(path, lambda meta: setattr(meta, "version", "2.0.0"), r"metadata version '2.0.0'")


def test_other_olmo_core_globals_stay_refused(tmp_path: Path) -> None:
    """Only OLMo-core's `_StorageInfo` is allowed, not its module."""
    from olmo_core.distributed.checkpoint.filesystem import _StoragePrefix

    path = _save(tmp_path / "ck", _state())
    meta = _read(path)
    meta.planner_data = _StoragePrefix("__0_")
    _write(path, meta)
    with pytest.raises(UnsafePickleError, match=r"'olmo_core\..*_StoragePrefix'"):
        read_dcp_layout(str(path), Storage())
