"""Lazy, code-free reading of files written by `torch.save` (the zip format, torch >= 1.6).

Layout (https://pytorch.org/docs/stable/notes/serialization.html and torch/serialization.py):
a zip archive of *stored* (uncompressed) records under one top folder, `<archive>/data.pkl`
(the pickle), `<archive>/data/<key>` (one raw little-endian record per storage, its data
aligned to 64 bytes), `<archive>/byteorder`, `<archive>/version`. In the pickle a tensor is
`torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, ...)` and a storage is
the persistent id `('storage', <storage type>, key, location, numel)`.

The restricted unpickler below maps those calls to `TensorRecord`s (no bytes are read), maps
the bookkeeping classes real DeepSpeed checkpoints contain to inert records, and refuses every
other global, so nothing in a checkpoint ever runs. Zip format:
https://pkware.cachefly.net/webdocs/casestudies/APPNOTE.TXT
"""

from __future__ import annotations

import bisect
import collections
import io
import logging
import math
import pickle
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from zerosafe.dtypes import dtype_info
from zerosafe.errors import CheckpointFormatError, IntegrityError, UnsafePickleError
from zerosafe.io.storage import ByteSource

__all__ = [
    "contiguous_stride",
    "ALLOWED_GLOBALS",
    "DTypeToken",
    "InertObject",
    "StorageRef",
    "TensorRecord",
    "TorchDevice",
    "TorchSize",
    "TorchZipFile",
    "ZipRecord",
]

log = logging.getLogger(__name__)

# Local file header: signature, version, flags, method, time, date, crc, sizes, name/extra length.
# APPNOTE.TXT section 4.3.7.
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_LOCAL_SIGNATURE = b"PK\x03\x04"


@dataclass(frozen=True, kw_only=True, slots=True)
class ZipRecord:
    """One stored record of the archive."""

    name: str
    header_offset: int
    size_bytes: int
    crc32: int
    """The recorded CRC32; 0 with a non-empty record means torch saved without CRCs."""

    @property
    def has_crc(self) -> bool:
        return self.crc32 != 0 or self.size_bytes == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageRef:
    """A storage named in the pickle: which record holds it and how many elements it has."""

    key: str
    dtype: str
    numel: int
    location: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorRecord:
    """A tensor as the pickle describes it; its bytes stay in the file until asked for."""

    storage: StorageRef
    storage_offset: int
    """In elements of `dtype`."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    is_parameter: bool = False
    """Saved as an `nn.Parameter`; `requires_grad` is then the parameter's flag."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtype_info(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


class InertObject:
    """Stands in for a bookkeeping object (a loss scaler, an enum): keeps its data, runs nothing.

    `args` are the constructor arguments the pickle passed and `state` what it would have set
    with `__setstate__`; `get` reads a field from either.
    """

    qualname: ClassVar[str] = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> InertObject:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    args: tuple[Any, ...]
    state: Any

    def get(self, field: str, default: Any = None) -> Any:
        if isinstance(self.state, dict) and field in self.state:
            return self.state[field]
        if (
            isinstance(self.state, tuple)
            and len(self.state) == 2
            and isinstance(self.state[1], dict)
        ):
            return self.state[1].get(field, default)  # (dict state, slot state)
        return default

    @property
    def value(self) -> Any:
        """The first constructor argument: an enum's value (`ZeroStageEnum(2)` -> 2)."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<inert {self.qualname} args={self.args!r} state={self.state!r}>"


def _inert(qualname: str) -> type[InertObject]:
    return type(qualname.rsplit(".", 1)[-1], (InertObject,), {"qualname": qualname})


class _StorageType:
    """The global a persistent id names as the storage's type (`torch.FloatStorage`)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _DTypeToken(str):
    """A torch dtype named in a pickle (`torch.float16`), kept as its name."""


DTypeToken = _DTypeToken


class TorchSize(tuple):  # type: ignore[type-arg]
    """A `torch.Size` named in a pickle: a plain tuple of ints that remembers it was one."""


class TorchDevice(str):
    """A `torch.device` named in a pickle, kept as its name (`cuda:0`)."""


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides torch gives a new contiguous tensor of `shape` (size-0 dims count as 1)."""
    stride = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _rebuild_tensor_v2(
    storage: tuple[StorageRef, str],
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> TensorRecord:
    # a typed storage: the tensor's dtype is the storage's
    ref = _storage_ref(storage)
    return _rebuild_tensor_v3(
        storage, storage_offset, size, stride, requires_grad, backward_hooks, ref.dtype
    )


def _rebuild_tensor_v3(
    storage: tuple[StorageRef, str],
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    backward_hooks: Any,
    dtype: str,
    metadata: Any = None,
) -> TensorRecord:
    # v3 is used with untyped (byte) storages: the offset is in elements of `dtype`.
    return TensorRecord(
        storage=_storage_ref(storage),
        storage_offset=_exact_int(storage_offset, "storage offset"),
        shape=tuple(_exact_int(s, "size") for s in size),
        stride=tuple(_exact_int(s, "stride") for s in stride),
        dtype=str(dtype),
        requires_grad=bool(requires_grad),
    )


def _storage_ref(storage: Any) -> StorageRef:
    ref = storage[0] if isinstance(storage, tuple) and len(storage) == 2 else storage
    if not isinstance(ref, StorageRef):
        raise CheckpointFormatError(
            f"a tensor is rebuilt from {type(ref).__name__} {ref!r} where torch.save writes a "
            "storage reference; the file was not written by torch.save"
        )
    return ref


def _exact_int(value: Any, what: str) -> int:
    # int() would quietly turn 2.7 into 2 or '3' into 3; torch.save writes Python ints only.
    if type(value) is not int:
        raise CheckpointFormatError(
            f"a tensor's {what} is {type(value).__name__} {value!r}, expected an int; the file "
            "was not written by torch.save"
        )
    return value


def _rebuild_tensor_v1(
    storage: tuple[StorageRef, str], storage_offset: int, size: Any, stride: Any
) -> TensorRecord:
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(
    data: TensorRecord, requires_grad: bool, backward_hooks: Any
) -> TensorRecord:
    if not isinstance(data, TensorRecord):
        return data
    return replace(data, requires_grad=bool(requires_grad), is_parameter=True)


def _rebuild_parameter_with_state(
    data: TensorRecord, requires_grad: bool, backward_hooks: Any, state: Any
) -> TensorRecord:
    return _rebuild_parameter(data, requires_grad, backward_hooks)


class _TensorClass:
    """`torch.Tensor` / `torch.nn.Parameter` as named by `_rebuild_from_type_v2`."""

    def __init__(self, name: str) -> None:
        self.name = name


def _rebuild_from_type_v2(
    func: Callable[..., Any], new_type: Any, args: tuple[Any, ...], state: Any
) -> Any:
    # Only our own rebuild functions can arrive here (the allowlist resolved `func`).
    if not isinstance(new_type, _TensorClass):
        raise UnsafePickleError(f"tensor subclass {new_type!r} is not supported")
    return func(*args)


def _codecs_encode(text: str, encoding: str = "utf-8") -> bytes:
    # Protocol-2 pickles spell `bytes` objects as `_codecs.encode(text, 'latin1')`.
    if encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise UnsafePickleError(f"_codecs.encode with encoding '{encoding}' is not allowed")
    return text.encode(encoding)


def _bytearray_of_data(*args: Any) -> bytearray:
    # bytearray(10**12) would allocate whatever a file asks for: only data is accepted.
    if args and not isinstance(args[0], (bytes, str, list)):
        raise UnsafePickleError(
            f"bytearray({type(args[0]).__name__}) is not allowed: only bytearray(data)"
        )
    return bytearray(*args)


def _empty_bytes(*args: Any) -> bytes:
    # Protocol-2 pickles spell b"" as `bytes()`; any argument (`bytes(10**12)`) is refused.
    if args:
        raise UnsafePickleError(f"bytes{args!r} is not allowed; only bytes() is")
    return b""


def _torch_size(*args: Any) -> tuple[int, ...]:
    return TorchSize(args[0]) if args else TorchSize()


def _torch_device(*args: Any) -> str:
    return TorchDevice(":".join(str(a) for a in args))


_STORAGE_TYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "UntypedStorage": "uint8",
}

_TORCH_DTYPES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "uint16", "uint32", "uint64", "bool", "complex64", "complex128", "float8_e4m3fn",
    "float8_e5m2",
)  # fmt: skip

# Bookkeeping classes: kept as inert records, never constructed for real.
_INERT_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
    "deepspeed.checkpoint.constants.ZeroStageEnum",
    "argparse.Namespace",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
)

ALLOWED_GLOBALS: dict[str, Any] = {
    # Containers and plain data constructors.
    "collections.OrderedDict": collections.OrderedDict,
    "collections.defaultdict": collections.defaultdict,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.complex": complex,
    "builtins.slice": slice,
    "builtins.bytearray": _bytearray_of_data,
    # Protocol-2 pickles (torch.save's default) spell builtins the Python 2 way.
    "__builtin__.set": set,
    "__builtin__.frozenset": frozenset,
    "__builtin__.complex": complex,
    "__builtin__.slice": slice,
    "__builtin__.bytearray": _bytearray_of_data,
    "__builtin__.bytes": _empty_bytes,
    "builtins.bytes": _empty_bytes,
    "_codecs.encode": _codecs_encode,
    # Tensor rebuild functions: all produce lazy `TensorRecord`s.
    "torch._utils._rebuild_tensor": _rebuild_tensor_v1,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch.Tensor": _TensorClass("torch.Tensor"),
    "torch.nn.parameter.Parameter": _TensorClass("torch.nn.parameter.Parameter"),
    "torch.Size": _torch_size,
    "torch.device": _torch_device,
    **{f"torch.{name}": _StorageType(dtype) for name, dtype in _STORAGE_TYPES.items()},
    "torch.storage.UntypedStorage": _StorageType("uint8"),
    **{f"torch.{name}": _DTypeToken(name) for name in _TORCH_DTYPES},
    **{name: _inert(name) for name in _INERT_GLOBALS},
}
"""Every global a checkpoint pickle may name, and what it becomes. Anything else is refused."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, url: str) -> None:
        super().__init__(io.BytesIO(data))
        self._url = url
        self.globals_found: set[str] = set()
        self.storages: dict[str, StorageRef] = {}

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{module}.{name}"
        try:
            target = ALLOWED_GLOBALS[qualname]
        except KeyError:
            raise UnsafePickleError(
                f"{self._url}: the pickle names the global '{qualname}', which is not on "
                "zerosafe's allowlist, so the file was not loaded (loading it could run code). "
                "If this is a legitimate checkpoint, report the global so it can be added to "
                "ALLOWED_GLOBALS in zerosafe/formats/torch_zip.py."
            ) from None
        self.globals_found.add(qualname)
        return target

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointFormatError(f"{self._url}: unexpected persistent id {pid!r}")
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise CheckpointFormatError(f"{self._url}: storage of unknown type {storage_type!r}")
        if type(numel) is not int or numel < 0:
            raise CheckpointFormatError(
                f"{self._url}: storage '{key}' has {numel!r} elements, expected a count >= 0; "
                "the file is corrupt or was not written by torch.save"
            )
        ref = StorageRef(
            key=str(key), dtype=storage_type.dtype, numel=numel, location=str(location)
        )
        known = self.storages.get(ref.key)
        if known is not None and known != ref:
            # torch.save refuses to save one storage under two types; a file that does would
            # size its views against whichever reference came first.
            raise CheckpointFormatError(
                f"{self._url}: storage '{key}' is named twice with different types or sizes "
                f"({known.numel} x {known.dtype}, then {ref.numel} x {ref.dtype}); the file "
                "was not written by torch.save"
            )
        self.storages[ref.key] = ref
        return (ref, storage_type.dtype)


class _PrefetchedIO(io.RawIOBase):
    """A read-only, seekable file object over a `ByteSource`, for `zipfile`.

    Reads inside a prefetched segment are served from memory; others go to the source as one
    ranged read of exactly the bytes asked for (no read-ahead buffer: on an object store a
    buffer would fetch bytes nobody needs).
    """

    def __init__(self, source: ByteSource) -> None:
        self._source = source
        self._pos = 0
        self._segments: list[tuple[int, bytes]] = []

    def prefetch(self, start: int, end: int) -> bytes:
        """Read `[start, end)` once; a segment that ends where another begins joins it."""
        data = self._source.read_range(start, end) if end > start else b""
        for i, (other_start, other) in enumerate(self._segments):
            if other_start == end:
                self._segments[i] = (start, data + other)
                return data
        self._segments.append((start, data))
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._source.size_bytes}[
            whence
        ]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self._source.size_bytes - self._pos))
        if not n:
            return 0
        for start, data in self._segments:
            if start <= self._pos and self._pos + n <= start + len(data):
                view[:n] = data[self._pos - start : self._pos - start + n]
                break
        else:
            self._source.readinto_at(self._pos, view[:n])
        self._pos += n
        return n


# End records, APPNOTE.TXT 4.3.14-4.3.16: the end of central directory record (22 bytes
# without a comment), the ZIP64 end of central directory locator (20) and record (56).
_EOCD = struct.Struct("<4s4H2LH")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_TAIL_BYTES = _EOCD.size + _ZIP64_LOCATOR.size + _ZIP64_EOCD.size


def _central_directory_start(tail: bytes, tail_start: int) -> int | None:
    """Where the central directory begins, from the file's last bytes; None if unsure (a
    comment after the end record, a ZIP64 record outside `tail`): zipfile then searches."""
    if len(tail) < _EOCD.size:
        return None
    sig, _, _, _, _, _, cd_offset, comment_len = _EOCD.unpack(tail[-_EOCD.size :])
    if sig != b"PK\x05\x06" or comment_len != 0:
        return None
    loc_end = len(tail) - _EOCD.size
    if loc_end >= _ZIP64_LOCATOR.size:
        loc = _ZIP64_LOCATOR.unpack(tail[loc_end - _ZIP64_LOCATOR.size : loc_end])
        if loc[0] == b"PK\x06\x07":
            rel = loc[2] - tail_start
            if rel < 0 or rel + _ZIP64_EOCD.size > len(tail):
                return None
            record = _ZIP64_EOCD.unpack(tail[rel : rel + _ZIP64_EOCD.size])
            if record[0] != b"PK\x06\x06":
                return None
            return int(record[9])
    return None if cd_offset == 0xFFFFFFFF else int(cd_offset)


class TorchZipFile:
    """The directory and pickle of one `torch.save` zip file, read without running code.

    Args:
        source: The file. Only the zip directory is read here; `load` reads the pickle.

    Raises:
        CheckpointFormatError: If the file is not a zip-format torch file, is a legacy
            (pre-1.6) torch file, is truncated, or holds compressed records.
    """

    def __init__(self, source: ByteSource) -> None:
        self.source = source
        self.url = source.url
        self._data_offsets: dict[str, int] = {}
        self._lock = threading.Lock()
        self._directory_start = source.size_bytes
        self.records = self._read_directory()
        self._header_offsets = sorted(r.header_offset for r in self.records.values())
        pickles = [n for n in self.records if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointFormatError(
                f"{self.url}: expected one '<archive>/data.pkl' record in a torch zip file, "
                f"found {len(pickles)}; this is not a file written by torch.save"
            )
        self.prefix = pickles[0][: -len("data.pkl")]
        self.globals_found: set[str] = set()
        self.storages: dict[str, StorageRef] = {}
        byteorder = self.records.get(self.prefix + "byteorder")
        if byteorder is not None and self.read_record(byteorder) != b"little":
            raise CheckpointFormatError(
                f"{self.url}: saved on a big-endian machine; zerosafe reads little-endian files. "
                "Load and re-save it with torch on a little-endian machine."
            )

    def _read_directory(self) -> dict[str, ZipRecord]:
        # Two exact ranged reads (the end records, then the central directory) instead of
        # zipfile's several small ones: this is what an object store bills and waits for.
        size = self.source.size_bytes
        raw = _PrefetchedIO(self.source)
        tail_start = max(0, size - _TAIL_BYTES)
        tail = raw.prefetch(tail_start, size)
        cd_start = _central_directory_start(tail, tail_start)
        if cd_start is not None and 0 <= cd_start <= size:
            raw.prefetch(cd_start, tail_start)
        try:
            with zipfile.ZipFile(raw) as zf:
                infos = zf.infolist()
                self._directory_start = int(getattr(zf, "start_dir", size))
        except zipfile.BadZipFile as e:
            head = self.source.read_range(0, min(8, size))
            if head.startswith(_LOCAL_SIGNATURE):
                raise CheckpointFormatError(
                    f"{self.url}: the zip directory at the end of the file is missing or "
                    f"damaged ({e}); the file is truncated ({size} bytes) or corrupt. Copy it "
                    "again from the training run's storage."
                ) from e
            if head[:1] == b"\x80":
                raise CheckpointFormatError(
                    f"{self.url}: this is a legacy (non-zip) torch file, which cannot be read "
                    "lazily or safely. Re-save it in the zip format with torch >= 1.6: "
                    "`torch.save(torch.load(path, weights_only=False), new_path)`, on a machine "
                    "where you trust the file."
                ) from e
            raise CheckpointFormatError(
                f"{self.url}: not a torch checkpoint (no zip archive found; starts with "
                f"{head!r}). Expected a file written by torch.save."
            ) from e
        records = {}
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointFormatError(
                    f"{self.url}: record '{info.filename}' is compressed; torch.save writes "
                    "stored records only. Was the file re-zipped by another tool?"
                )
            if info.header_offset + info.file_size > size:
                raise CheckpointFormatError(
                    f"{self.url}: record '{info.filename}' ends past the end of the file; "
                    "the file is truncated or corrupt."
                )
            records[info.filename] = ZipRecord(
                name=info.filename,
                header_offset=info.header_offset,
                size_bytes=info.file_size,
                crc32=info.CRC,
            )
        return records

    # -- records ------------------------------------------------------------------------------

    def storage_record(self, key: str) -> ZipRecord:
        """The record that holds storage `key`."""
        try:
            return self.records[f"{self.prefix}data/{key}"]
        except KeyError:
            raise CheckpointFormatError(
                f"{self.url}: the pickle names storage '{key}' but the archive has no record "
                f"'{self.prefix}data/{key}'; the file is corrupt."
            ) from None

    def data_offset(self, record: ZipRecord) -> int:
        """Absolute file offset of the record's first data byte (reads its local header)."""
        with self._lock:
            cached = self._data_offsets.get(record.name)
        if cached is not None:
            return cached
        header = self.source.read_range(
            record.header_offset, record.header_offset + _LOCAL_HEADER.size
        )
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != _LOCAL_SIGNATURE:
            raise CheckpointFormatError(
                f"{self.url}: no local zip header at offset {record.header_offset} for "
                f"'{record.name}'; the file is corrupt."
            )
        name_len, extra_len = fields[9], fields[10]
        offset = int(record.header_offset + _LOCAL_HEADER.size + name_len + extra_len)
        if offset + record.size_bytes > self.source.size_bytes:
            raise CheckpointFormatError(
                f"{self.url}: record '{record.name}' ({record.size_bytes} bytes at offset "
                f"{offset}) runs past the end of the file ({self.source.size_bytes} bytes); "
                "the file is truncated."
            )
        with self._lock:
            self._data_offsets[record.name] = offset
        return offset

    @property
    def directory_bytes(self) -> int:
        """Bytes of the central directory and end records: what listing the archive reads."""
        return self.source.size_bytes - self._directory_start

    def _read_with_header(self, record: ZipRecord) -> bytes | None:
        """The record's data, read together with its local header in one request, when the
        next record follows closely (torch writes them back to back); None otherwise."""
        i = bisect.bisect_right(self._header_offsets, record.header_offset)
        end = self._header_offsets[i] if i < len(self._header_offsets) else self._directory_start
        span = end - record.header_offset
        if not _LOCAL_HEADER.size <= span <= _LOCAL_HEADER.size + record.size_bytes + 4096:
            return None
        block = self.source.read_range(record.header_offset, end)
        fields = _LOCAL_HEADER.unpack(block[: _LOCAL_HEADER.size])
        if fields[0] != _LOCAL_SIGNATURE:
            raise CheckpointFormatError(
                f"{self.url}: no local zip header at offset {record.header_offset} for "
                f"'{record.name}'; the file is corrupt."
            )
        begin = _LOCAL_HEADER.size + fields[9] + fields[10]
        if begin + record.size_bytes > len(block):
            return None
        with self._lock:
            self._data_offsets[record.name] = record.header_offset + begin
        return block[begin : begin + record.size_bytes]

    def read_record(self, record: ZipRecord, *, check_crc: bool = True) -> bytes:
        """Read a whole record, checking its CRC32."""
        with self._lock:
            known = record.name in self._data_offsets
        data = None if known else self._read_with_header(record)
        if data is None:
            start = self.data_offset(record)
            data = self.source.read_range(start, start + record.size_bytes)
        if check_crc and record.has_crc and zlib.crc32(data) != record.crc32:
            raise IntegrityError(
                f"{self.url}: record '{record.name}' fails its CRC32 check (recorded "
                f"{record.crc32:08x}, read {zlib.crc32(data):08x}); the file is corrupt. Copy it "
                "again from the training run's storage."
            )
        return data

    # -- pickle -------------------------------------------------------------------------------

    def load(self) -> Any:
        """Unpickle `data.pkl` into plain containers, `TensorRecord`s and `InertObject`s."""
        data = self.read_record(self.records[self.prefix + "data.pkl"])
        unpickler = _RestrictedUnpickler(data, self.url)
        try:
            obj = unpickler.load()
        except (CheckpointFormatError, IntegrityError) as e:
            if str(e).startswith(self.url):
                raise
            raise type(e)(f"{self.url}: {e}") from e  # raised by a rebuild function
        except Exception as e:
            raise CheckpointFormatError(f"{self.url}: the pickle could not be read: {e}") from e
        self.globals_found |= unpickler.globals_found
        self.storages.update(unpickler.storages)
        for ref in unpickler.storages.values():
            record = self.storage_record(ref.key)
            want = ref.numel * dtype_info(ref.dtype).itemsize
            if record.size_bytes < want:
                raise CheckpointFormatError(
                    f"{self.url}: storage '{ref.key}' should hold {want} bytes "
                    f"({ref.numel} x {ref.dtype}) but its record has {record.size_bytes}; "
                    "the file is corrupt."
                )
        return obj

    # -- tensors ------------------------------------------------------------------------------

    def tensor_offset(self, tensor: TensorRecord) -> int:
        """Absolute file offset of a contiguous tensor's first byte."""
        record = self.storage_record(tensor.storage.key)
        return self.data_offset(record) + tensor.storage_offset * tensor.itemsize

    def read_tensor_bytes(self, tensor: TensorRecord) -> bytes:
        """The raw bytes of a (small) tensor in row-major order, gathered if it is strided."""
        if tensor.numel == 0:
            return b""
        if tensor.is_contiguous():
            start = self.tensor_offset(tensor)
            return self.source.read_range(start, start + tensor.nbytes)
        import numpy as np

        itemsize = tensor.itemsize
        span = 1 + sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride, strict=True))
        start = self.tensor_offset(tensor)
        raw = np.frombuffer(self.source.read_range(start, start + span * itemsize), dtype=np.uint8)
        elems = raw.view(f"V{itemsize}")
        strided = np.lib.stride_tricks.as_strided(
            elems, shape=tensor.shape, strides=tuple(s * itemsize for s in tensor.stride)
        )
        return np.ascontiguousarray(strided).tobytes()
