"""What pt2st refuses, and how it says so: unknown globals (named, never run), dtypes and values
the format cannot hold, legacy files, corrupt bytes, an existing output."""

from __future__ import annotations

import collections
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from zerosafe.errors import (
    CheckpointFormatError,
    IntegrityError,
    OutputExistsError,
    UnsafePickleError,
    UnsupportedCheckpointError,
)
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import Storage
from zerosafe.pt2st import convert_pt, inspect_pt, list_pt_globals, load_pt_like

RAN: list[str] = []


def _mark(what: str) -> str:
    RAN.append(what)  # would prove that loading ran code from the file
    return what


class Hook:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_mark, ("ran",))


class Config:
    def __init__(self) -> None:
        self.lr = 0.1


def _save(obj: object, path: Path) -> str:
    torch.save(obj, path)
    return str(path)


def test_unknown_globals_are_named_and_never_run(tmp_path: Path) -> None:
    pt = _save({"w": torch.ones(2), "hook": Hook(), "cfg": Config()}, tmp_path / "x.pt")
    out = tmp_path / "x.safetensors"
    with pytest.raises(UnsafePickleError, match="outside zerosafe's allowlist") as info:
        convert_pt(pt, str(out))
    message = str(info.value)
    assert f"'{__name__}._mark'" in message and f"'{__name__}.Config'" in message
    assert "--list-globals" in message
    assert isinstance(info.value.__cause__, UnsafePickleError)
    assert RAN == [] and not out.exists() and os.listdir(tmp_path) == ["x.pt"]
    found = {
        g["global"]: g["allowed"] for g in list_pt_globals(TorchZipFile(Storage().open_source(pt)))
    }
    assert found[f"{__name__}._mark"] is False and found[f"{__name__}.Config"] is False
    assert found["torch._utils._rebuild_tensor_v2"] is True
    assert RAN == []


def test_globals_are_listed_for_pickle_protocol_4(tmp_path: Path) -> None:
    pt = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(2), "hook": Hook()}, pt, pickle_protocol=4)
    found = {g["global"] for g in list_pt_globals(TorchZipFile(Storage().open_source(str(pt))))}
    assert f"{__name__}._mark" in found and "torch._utils._rebuild_tensor_v2" in found
    with pytest.raises(UnsafePickleError, match="_mark"):
        inspect_pt(str(pt))


def test_dtype_safetensors_cannot_hold_is_refused(tmp_path: Path) -> None:
    pt = _save(
        {"ok": torch.ones(2), "z": {"w": torch.ones(2, dtype=torch.complex128)}}, tmp_path / "c.pt"
    )
    with pytest.raises(UnsupportedCheckpointError, match=r"\['z'\]\['w'\] has dtype 'complex128'"):
        convert_pt(pt, str(tmp_path / "c.safetensors"))
    assert not (tmp_path / "c.safetensors").exists()


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.array([1, "a"], dtype=object), "numpy"),
        (np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]), "numpy"),
        (collections.defaultdict(list), "builtin"),
    ],
)
def test_values_json_cannot_hold_are_refused(tmp_path: Path, value: object, match: str) -> None:
    pt = _save({"v": value}, tmp_path / "v.pt")
    with pytest.raises(CheckpointFormatError, match=match):
        convert_pt(pt, str(tmp_path / "v.safetensors"))


def test_self_referencing_structure_is_refused(tmp_path: Path) -> None:
    loop: list[object] = [torch.ones(1)]
    loop.append(loop)
    pt = _save({"loop": loop}, tmp_path / "l.pt")
    with pytest.raises(
        UnsupportedCheckpointError, match=r"l.pt: the container at \['loop'\]\[1\] contains itself"
    ):
        convert_pt(pt, str(tmp_path / "l.safetensors"))


def test_legacy_format_converts_like_the_zip_format(tmp_path: Path) -> None:
    """Legacy (non-zip) files are read lazily with the same unpickler: same output bytes as
    the zip format's file of the same object."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "v": torch.arange(6.0)[2:5], "n": 3}
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    torch.save(state, tmp_path / "new.pt")
    convert_pt(str(tmp_path / "old.pt"), str(tmp_path / "old.safetensors"))
    convert_pt(str(tmp_path / "new.pt"), str(tmp_path / "new.safetensors"))
    old, new = load_pt_like(str(tmp_path / "old.safetensors")), torch.load(tmp_path / "new.pt")
    assert old["n"] == new["n"] and all(torch.equal(old[k], new[k]) for k in ("w", "v"))


def test_corrupt_storage_fails_crc_and_writes_nothing(tmp_path: Path) -> None:
    pt = tmp_path / "x.pt"
    torch.save({"w": torch.arange(1000, dtype=torch.float32)}, pt)
    with zipfile.ZipFile(pt) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(pt.read_bytes())
    header = info.header_offset
    name_len = int.from_bytes(raw[header + 26 : header + 28], "little")
    extra_len = int.from_bytes(raw[header + 28 : header + 30], "little")
    raw[header + 30 + name_len + extra_len + 100] ^= 0xFF  # APPNOTE 4.3.7 local header
    pt.write_bytes(bytes(raw))
    out = tmp_path / "x.safetensors"
    with pytest.raises(IntegrityError, match="CRC32"):
        convert_pt(str(pt), str(out))
    assert sorted(os.listdir(tmp_path)) == ["x.pt"]  # no output, no temporary file left


def test_existing_output_is_kept_unless_overwrite(tmp_path: Path) -> None:
    pt = _save({"w": torch.ones(3)}, tmp_path / "x.pt")
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"someone else's file")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        convert_pt(pt, str(out))
    assert out.read_bytes() == b"someone else's file"
    assert convert_pt(pt, str(out), overwrite=True)["status"] == "converted"
    # Run again: the output already holds this very source, so nothing is rewritten.
    mtime = out.stat().st_mtime_ns
    assert convert_pt(pt, str(out))["status"] == "already-complete"
    assert out.stat().st_mtime_ns == mtime
    # The source changed: the old output is another file now.
    _save({"w": torch.ones(4)}, tmp_path / "x.pt")
    with pytest.raises(OutputExistsError):
        convert_pt(pt, str(out))


def test_truncated_output_is_refused_on_load(tmp_path: Path) -> None:
    pt = _save({"w": torch.ones(300)}, tmp_path / "x.pt")
    out = tmp_path / "x.safetensors"
    convert_pt(pt, str(out))
    out.write_bytes(out.read_bytes()[:-10])
    with pytest.raises(CheckpointFormatError, match="truncated"):
        load_pt_like(str(out))


def test_damaged_view_record_is_caught_by_verify_and_load(tmp_path: Path) -> None:
    import json
    import struct

    from zerosafe.errors import VerificationError
    from zerosafe.pt2st import verify_pt

    base = torch.arange(10.0)
    pt = _save({"a": base, "b": base[2:5]}, tmp_path / "x.pt")
    out = tmp_path / "x.safetensors"
    convert_pt(pt, str(out))
    raw = out.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["__metadata__"]["zerosafe.pt2st.tree"] = header["__metadata__"][
        "zerosafe.pt2st.tree"
    ].replace('"offset":2', '"offset":9')
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    out.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    with pytest.raises(VerificationError, match="view past its entry"):
        verify_pt(str(out))
    with pytest.raises(CheckpointFormatError, match="reaches past its 40 bytes"):
        load_pt_like(str(out))
