"""Write files that `torch.load` reads, without torch: the zip format of `torch.save`, streamed.

Layout (torch/serialization.py, `_save`; https://pytorch.org/docs/stable/notes/serialization.html),
as torch 2.13 writes it: a zip archive of *stored* records under one top folder,
`archive/data.pkl` (the pickle, protocol 2), `archive/.format_version` (`1`),
`archive/.storage_alignment` (`64`), `archive/byteorder` (`little`), `archive/data/<key>` (one
record per storage: raw little-endian elements, the data aligned to 64 bytes by padding the
local header's extra field, id `FB`), `archive/version` (`3\\n`). Every record is written with
general-purpose flag bit 3, as torch does: the local header carries no CRC and sizes, a data
descriptor after the data does, so a record of any size streams through a sequential sink
with its CRC-32 computed on the way. Records, offsets or counts past the 32-bit fields use
ZIP64 extra fields and end records (APPNOTE.TXT 4.3.9, 4.4.3, 4.5.3:
https://pkware.cachefly.net/webdocs/casestudies/APPNOTE.TXT).

In the pickle a tensor is `torch._utils._rebuild_tensor_v2(storage, storage_offset, size,
stride, requires_grad, OrderedDict())` and a storage the persistent id `('storage',
torch.<Type>Storage, key, 'cpu', numel)`: `TensorOut` stands for one. Objects the restricted
reader kept as `InertObject`s (DeepSpeed's loss scaler, `ZeroStageEnum`) are written back as
the global they came from, with the same arguments and state.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from zerosafe.dtypes import DTYPES, dtype_info
from zerosafe.formats.crc import crc32_combine
from zerosafe.formats.torch_pickle import DTypeToken, InertObject, TorchDevice, TorchSize
from zerosafe.io.storage import Sink

__all__ = [
    "ARCHIVE",
    "STORAGE_ALIGNMENT",
    "TensorOut",
    "TorchZipWriter",
    "pickle_bytes",
    "storage_type_of",
]

ARCHIVE = "archive"
STORAGE_ALIGNMENT = 64
_ZIP32_MAX = 0xFFFFFFFF
_ZIP16_MAX = 0xFFFF
_FLAGS = 0x0808  # bit 3: sizes and CRC in a data descriptor; bit 11: UTF-8 names (as torch)
_VERSION_ZIP = 20
_VERSION_ZIP64 = 45
_DOS_DATE = 0x21  # 1980-01-01 00:00, as torch writes: archives of equal content are equal bytes
_PAD_ID = 0x4246  # "FB": torch's padding extra field
_ZIP64_ID = 0x0001


def storage_type_of(dtype: str) -> str:
    """The typed-storage global torch names in the pickle for `dtype` (`FloatStorage`)."""
    storage_class = DTYPES[dtype].storage_class if dtype in DTYPES else None
    if storage_class is None:
        raise ValueError(f"no torch storage type for dtype '{dtype}'")
    return storage_class


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorOut:
    """A contiguous tensor to write: a view of the whole storage record `key`."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_info(self.dtype).itemsize

    @property
    def stride(self) -> tuple[int, ...]:
        out, step = [], 1
        for size in reversed(self.shape):
            out.append(step)
            step *= max(size, 1)
        return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class _Global:
    """A global the pickle names by module and name, never imported here."""

    module: str
    name: str

    def __call__(self, *args: Any) -> Any:  # the pickler requires a reduce function be callable
        raise TypeError(f"{self.module}.{self.name} is only named in a pickle, never called")


@dataclass(frozen=True, slots=True)
class _Storage:
    tensor: TensorOut


class _Pickler(pickle._Pickler):
    """The pure-Python pickler (its dispatch table can be extended) with torch's persistent
    ids, and globals written by name (DeepSpeed need not be importable)."""

    dispatch: ClassVar[dict[type, Callable[[Any, Any], None]]] = dict(pickle._Pickler.dispatch)

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            t = obj.tensor
            return ("storage", _Global("torch", storage_type_of(t.dtype)), t.key, "cpu", t.numel)
        return None

    def _save_global_name(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]

    def _save_tensor(self, obj: TensorOut) -> None:
        hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        args = (_Storage(obj), 0, obj.shape, obj.stride, obj.requires_grad, hooks)
        self.save_reduce(_Global("torch._utils", "_rebuild_tensor_v2"), args, obj=obj)  # type: ignore[attr-defined]

    def _save_inert(self, obj: InertObject) -> None:
        module, _, name = type(obj).qualname.rpartition(".")
        cls = _Global(module, name)
        save = self.save
        if obj.state is None:
            self.save_reduce(cls, tuple(obj.args), obj=obj)  # type: ignore[attr-defined]
            return
        save(cls)
        save(tuple(obj.args))
        self.write(pickle.NEWOBJ)  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]
        save(obj.state)
        self.write(pickle.BUILD)  # type: ignore[attr-defined]

    def _save_size(self, obj: TorchSize) -> None:
        self.save_reduce(_Global("torch", "Size"), (tuple(obj),), obj=obj)  # type: ignore[attr-defined]

    def _save_dtype(self, obj: DTypeToken) -> None:
        self._save_global_name(_Global("torch", str(obj)))

    def _save_device(self, obj: TorchDevice) -> None:
        self.save_reduce(_Global("torch", "device"), (str(obj),), obj=obj)  # type: ignore[attr-defined]

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        # Subclasses of InertObject are made per global: dispatch on the base class.
        if isinstance(obj, InertObject):
            self.framer.commit_frame()  # type: ignore[attr-defined]
            memo = self.memo.get(id(obj))  # type: ignore[attr-defined]
            if memo is not None:
                self.write(self.get(memo[0]))  # type: ignore[attr-defined]
                return
            self._save_inert(obj)
            return
        super().save(obj, save_persistent_id)  # type: ignore[misc]


_Pickler.dispatch[_Global] = _Pickler._save_global_name
_Pickler.dispatch[TensorOut] = _Pickler._save_tensor
_Pickler.dispatch[TorchSize] = _Pickler._save_size
_Pickler.dispatch[DTypeToken] = _Pickler._save_dtype
_Pickler.dispatch[TorchDevice] = _Pickler._save_device


def pickle_bytes(obj: Any) -> bytes:
    """`data.pkl` of `obj`: plain containers and scalars, `TensorOut`s, `InertObject`s,
    `TorchSize`, dtype and device names, pickled as `torch.save` does (protocol 2)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


@dataclass(kw_only=True, slots=True)
class _Entry:
    name: bytes
    header_offset: int
    crc32: int = 0
    size_bytes: int = 0


@dataclass(kw_only=True)
class TorchZipWriter:
    """Streams one `torch.save` archive into `sink`: `add(name, data)` for small records,
    `begin(name)` / `write(chunk)` / `end()` for a storage of any size, then `close()`.

    `zip64` forces ZIP64 records whatever the sizes (tests exercise that path on small files);
    otherwise they are used where a value does not fit 32 bits.
    """

    sink: Sink
    archive: str = ARCHIVE
    zip64: bool = False
    _offset: int = 0
    _entries: list[_Entry] = field(default_factory=list)
    _open: _Entry | None = None
    _open_zip64: bool = False

    def _emit(self, data: bytes | memoryview) -> None:
        self.sink.write(data)
        self._offset += memoryview(data).nbytes

    def begin(self, name: str, *, size_bytes: int) -> None:
        """Start record `archive/<name>` of `size_bytes` bytes, its data 64-byte aligned."""
        assert self._open is None, "a record is still open"
        full = f"{self.archive}/{name}".encode()
        entry = _Entry(name=full, header_offset=self._offset)
        big = self.zip64 or size_bytes >= _ZIP32_MAX or self._offset >= _ZIP32_MAX
        extra = struct.pack("<HHQQ", _ZIP64_ID, 16, 0, 0) if big else b""
        size_field = _ZIP32_MAX if big else 0
        base = self._offset + 30 + len(full) + len(extra) + 4
        pad = (-base) % STORAGE_ALIGNMENT
        extra += struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
        header = struct.pack(
            "<4s5H3L2H", b"PK\x03\x04", _VERSION_ZIP64 if big else _VERSION_ZIP, _FLAGS, 0, 0,
            _DOS_DATE, 0, size_field, size_field, len(full), len(extra),
        )  # fmt: skip
        self._emit(header + full + extra)
        self._open, self._open_zip64 = entry, big

    def write(self, chunk: bytes | memoryview, *, crc32: int | None = None) -> None:
        """Append to the open record; `crc32`: the chunk's own CRC-32 when already known."""
        entry = self._open
        assert entry is not None, "no record is open"
        n = memoryview(chunk).nbytes
        if crc32 is None:
            entry.crc32 = zlib.crc32(chunk, entry.crc32)
        else:
            entry.crc32 = crc32_combine(entry.crc32, crc32, n)
        entry.size_bytes += n
        self._emit(chunk)

    def end(self) -> int:
        """Close the open record with its data descriptor; returns its CRC-32."""
        entry = self._open
        assert entry is not None, "no record is open"
        if self._open_zip64:
            desc = struct.pack(
                "<4sLQQ", b"PK\x07\x08", entry.crc32, entry.size_bytes, entry.size_bytes
            )
        else:
            desc = struct.pack(
                "<4sLLL", b"PK\x07\x08", entry.crc32, entry.size_bytes, entry.size_bytes
            )
        self._emit(desc)
        self._entries.append(entry)
        self._open = None
        return entry.crc32

    def add(self, name: str, data: bytes) -> int:
        """A whole small record; returns its CRC-32."""
        self.begin(name, size_bytes=len(data))
        self.write(data)
        return self.end()

    def add_preamble(self, pickled: bytes) -> None:
        """`data.pkl` and the small records torch writes before the storages."""
        self.add("data.pkl", pickled)
        self.add(".format_version", b"1")
        self.add(".storage_alignment", str(STORAGE_ALIGNMENT).encode())
        self.add("byteorder", b"little")

    def close(self) -> None:
        """`version`, then the central directory and end records. The sink is not committed."""
        assert self._open is None, "a record is still open"
        self.add("version", b"3\n")
        cd_start = self._offset
        directory = bytearray()
        for e in self._entries:
            sizes = [e.size_bytes, e.size_bytes]
            wide = [v >= _ZIP32_MAX or self.zip64 for v in (*sizes, e.header_offset)]
            values = [v for v, w in zip((*sizes, e.header_offset), wide, strict=True) if w]
            extra = (
                struct.pack(f"<HH{len(values)}Q", _ZIP64_ID, 8 * len(values), *values)
                if values
                else b""
            )
            fields = [
                (_ZIP32_MAX if w else v)
                for v, w in zip((*sizes, e.header_offset), wide, strict=True)
            ]
            version = _VERSION_ZIP64 if values else _VERSION_ZIP
            directory += struct.pack(
                "<4s6H3L5H2L", b"PK\x01\x02", version, version, _FLAGS, 0, 0, _DOS_DATE,
                e.crc32, fields[0], fields[1], len(e.name), len(extra), 0, 0, 0, 0, fields[2],
            )  # fmt: skip
            directory += e.name + extra
        self._emit(bytes(directory))
        cd_end = self._offset
        count, cd_size = len(self._entries), cd_end - cd_start
        if self.zip64 or count >= _ZIP16_MAX or cd_start >= _ZIP32_MAX or cd_size >= _ZIP32_MAX:
            self._emit(
                struct.pack(
                    "<4sQ2H2L4Q", b"PK\x06\x06", 44, _VERSION_ZIP64, _VERSION_ZIP64, 0, 0,
                    count, count, cd_size, cd_start,
                )
            )  # fmt: skip
            self._emit(struct.pack("<4sLQL", b"PK\x06\x07", 0, cd_end, 1))
            count16, size32, start32 = _ZIP16_MAX, _ZIP32_MAX, _ZIP32_MAX
        else:
            count16, size32, start32 = count, cd_size, cd_start
        self._emit(
            struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count16, count16, size32, start32, 0)
        )

    @property
    def bytes_written(self) -> int:
        return self._offset
