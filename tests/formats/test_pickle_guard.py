"""No pickle can change how a later file is read in the same process (issue 37, item 1;
DESIGN.md invariant 11).

The restricted unpicklers hand every load the same allowlisted objects. A hostile pickle names
one of them and applies state to it with the `BUILD` opcode: a dict state (written into the
object's `__dict__`) or `(None, slot state)` (each item set with `setattr`, which reaches even
a function's `__defaults__`). Before the fix, 60 bytes (`torch.FloatStorage`, `{'dtype':
'float16'}`, BUILD) loaded as a harmless object, and every later fp32 file in the process was
read as float16. The pickles below are assembled opcode by opcode, in protocols 2 and 4; each
must be refused with `UnsafePickleError` naming the file and the global, and honest files
(a `torch.save`d fp32 tensor, a `dcp.save`d checkpoint's `.metadata`) must read right after.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zerosafe.errors import CheckpointFormatError, UnsafePickleError
from zerosafe.formats.dcp import metadata as dcp_metadata
from zerosafe.formats.dcp.metadata import parse_metadata
from zerosafe.formats.pickle_guard import seal_table
from zerosafe.formats.torch_pickle import ALLOWED_GLOBALS, RestrictedUnpickler
from zerosafe.formats.torch_zip import TensorRecord, TorchZipFile
from zerosafe.io.storage import Storage

_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE
_MISSING = object()


def _hostile(qualname: str, state: Any, protocol: int) -> bytes:
    """`GLOBAL qualname`, `state`, `BUILD`, `STOP`: what no torch.save ever writes."""
    module, name = qualname.rsplit(".", 1)
    if protocol == 2:
        head = b"\x80\x02" + pickle.GLOBAL + f"{module}\n{name}\n".encode()
    else:
        head = b"\x80\x04"
        for part in (module, name):
            raw = part.encode()
            head += pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw
        head += pickle.STACK_GLOBAL
    body = pickle.dumps(state, protocol=2)[2:-1]  # the state's opcodes, no PROTO/STOP
    data = head + body + pickle.BUILD + pickle.STOP
    pickletools.dis(data, out=io.StringIO())  # well formed, opcode by opcode
    return data


def _attempt(load: Callable[..., Any], *args: Any) -> Exception | None:
    try:
        load(*args)
    except Exception as e:
        return e
    return None


def _states(attr: str, value: Any) -> list[Any]:
    return [{attr: value}, (None, {attr: value})]


def _torch_file(path: Path, data: bytes) -> Path:
    """A `torch.save`-shaped zip whose `data.pkl` is `data`."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data)
        z.writestr("archive/byteorder", "little")
    return path


def _load_torch_file(path: Path) -> Any:
    return TorchZipFile(Storage().open_source(str(path))).load()


def _snapshot(value: Any) -> dict[str, Any]:
    """Everything a BUILD could write: `__dict__` and slots."""
    found = dict(vars(value)) if hasattr(value, "__dict__") else {}
    for cls in type(value).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            found[slot] = getattr(value, slot, _MISSING)
    if callable(value):
        found["__defaults__"] = getattr(value, "__defaults__", _MISSING)
    return found


@pytest.fixture(scope="module")
def honest_fp32(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    path = tmp_path_factory.mktemp("honest") / "fp32.pt"
    torch.save({"w": tensor}, path)
    return path, tensor


@pytest.fixture(scope="module")
def honest_dcp(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("honest_dcp")
    with pytest.warns(UserWarning):  # no process group: torch warns, then saves in-process
        dcp.save({"w": torch.ones(5, 3)}, checkpoint_id=str(path))
    return (path / ".metadata").read_bytes()


def _assert_honest_files_read(honest_fp32: tuple[Path, torch.Tensor], honest_dcp: bytes) -> None:
    path, want = honest_fp32
    zf = TorchZipFile(Storage().open_source(str(path)))
    record = zf.load()["w"]
    assert isinstance(record, TensorRecord)
    assert record.dtype == "float32" and record.storage.dtype == "float32"
    got = torch.frombuffer(bytearray(zf.read_tensor_bytes(record)), dtype=torch.float32)
    assert torch.equal(got.reshape(want.shape), want)
    meta = parse_metadata(honest_dcp, "honest/.metadata")
    assert meta.tensors["w"].dtype == "float32" and meta.tensors["w"].size == (5, 3)


_TORCH_TARGETS = [
    ("torch.FloatStorage", "dtype", "float16"),  # the 60-byte file
    ("torch.storage.UntypedStorage", "dtype", "float64"),
    ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "qualname", "torch.Tensor"),
    ("torch.distributed.tensor._dtensor_spec.DTensorSpec", "__setstate__", None),
    ("torch._utils._rebuild_tensor_v2", "__defaults__", (True, None, None)),
    ("torch.Size", "__code__", None),
    ("torch.float32", "qualname", "torch.float16"),
    ("torch.Tensor", "qualname", "torch.nn.parameter.Parameter"),
    ("torch.distributed.tensor.DTensor", "qualname", "x"),
]


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize(("qualname", "attr", "value"), _TORCH_TARGETS)
def test_build_on_a_torch_global_is_refused(
    tmp_path: Path,
    honest_fp32: tuple[Path, torch.Tensor],
    honest_dcp: bytes,
    qualname: str,
    attr: str,
    value: Any,
    protocol: int,
) -> None:
    target = ALLOWED_GLOBALS[qualname]
    before = _snapshot(target)
    for i, state in enumerate(_states(attr, value)):
        path = _torch_file(tmp_path / f"hostile{i}.pt", _hostile(qualname, state, protocol))
        error = _attempt(_load_torch_file, path)
        # first what the issue saw: the next honest file read wrongly (fp32 as float16)
        _assert_honest_files_read(honest_fp32, honest_dcp)
        assert _snapshot(target) == before
        assert isinstance(error, UnsafePickleError), error
        assert re.match(rf"{re.escape(str(path))}: .*BUILD.* '{qualname}'", str(error))
        assert "\n" not in str(error)


_DCP_TARGETS = [
    ("torch.distributed.checkpoint.metadata.TensorStorageMetadata", "qualname", "x"),
    ("torch.distributed.checkpoint.filesystem._StorageInfo", "__setstate__", None),
    ("pathlib.PosixPath", "__defaults__", ("/etc",)),
    ("torch.Size", "__kwdefaults__", {}),
    ("torch.float32", "qualname", "torch.float16"),
]


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize(("qualname", "attr", "value"), _DCP_TARGETS)
def test_build_on_a_dcp_metadata_global_is_refused(
    honest_fp32: tuple[Path, torch.Tensor],
    honest_dcp: bytes,
    qualname: str,
    attr: str,
    value: Any,
    protocol: int,
) -> None:
    target = dcp_metadata.ALLOWED_GLOBALS[qualname]
    before = _snapshot(target)
    for state in _states(attr, value):
        error = _attempt(parse_metadata, _hostile(qualname, state, protocol), "h/.metadata")
        _assert_honest_files_read(honest_fp32, honest_dcp)
        assert _snapshot(target) == before
        assert isinstance(error, UnsafePickleError), error
        assert re.match(rf"h/\.metadata: .*BUILD.* '{qualname}'", str(error))


_TABLES: list[tuple[str, dict[str, Any], Callable[[bytes], Any]]] = [
    ("torch_pickle", ALLOWED_GLOBALS, lambda data: RestrictedUnpickler(data, "t.pkl").load()),
    ("dcp_metadata", dcp_metadata.ALLOWED_GLOBALS, lambda data: parse_metadata(data, "t.pkl")),
]


@pytest.mark.parametrize(("table", "load"), [t[1:] for t in _TABLES], ids=[t[0] for t in _TABLES])
def test_no_table_value_can_be_changed(table: dict[str, Any], load: Callable[[bytes], Any]) -> None:
    """Every value either table hands out, present and future: setattr and BUILD (dict and slot
    state) leave it as it was. Builtin types are immutable; everything else refuses BUILD with
    `UnsafePickleError`."""
    for qualname, target in table.items():
        before = _snapshot(target)
        with pytest.raises((AttributeError, TypeError)):
            target.zerosafe_probe = 1
        builtin = isinstance(target, type) and bool(target.__flags__ & _IMMUTABLE_TYPE)
        # a builtin type fails as it would anywhere (DCP's reader words it as a bad file)
        expected = (TypeError, CheckpointFormatError) if builtin else UnsafePickleError
        for state in _states("zerosafe_probe", 1) + _states("qualname", "x"):
            with pytest.raises(expected) as e:
                load(_hostile(qualname, state, 2))
            if not builtin:
                assert f"'{qualname}'" in str(e.value), qualname
        assert _snapshot(target) == before, qualname
        assert getattr(target, "zerosafe_probe", _MISSING) is _MISSING, qualname


def test_a_mutable_table_entry_is_refused_at_import() -> None:
    class Token:
        pass

    with pytest.raises(TypeError, match="allowlist entry 'x.Token' is a Token"):
        seal_table({"x.Token": Token()})
    table: dict[str, Any] = {"x.f": lambda: 3}
    seal_table(table)
    assert table["x.f"]() == 3
    with pytest.raises(AttributeError):
        table["x.f"].function = print


def test_inert_instances_still_take_their_state() -> None:
    """The sealed class keeps building fresh instances: NEWOBJ then BUILD, as DeepSpeed's loss
    scaler is pickled."""
    data = (
        b"\x80\x02cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n)\x81"
        b"}X\x09\x00\x00\x00cur_scaleG?\xf0\x00\x00\x00\x00\x00\x00sb."
    )
    first = RestrictedUnpickler(data, "a.pkl").load()
    second = RestrictedUnpickler(data, "b.pkl").load()
    assert first.state == {"cur_scale": 1.0} and first is not second
    assert type(first).qualname == "deepspeed.runtime.fp16.loss_scaler.LossScaler"
