"""Lazy, code-free reading of files written by `torch.save` (the zip format, torch >= 1.6).

Layout (https://pytorch.org/docs/stable/notes/serialization.html and torch/serialization.py):
a zip archive of *stored* (uncompressed) records under one top folder, `<archive>/data.pkl`
(the pickle), `<archive>/data/<key>` (one raw little-endian record per storage, its data
aligned to 64 bytes), `<archive>/byteorder`, `<archive>/version`. In the pickle a tensor is
`torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, ...)` and a storage is
the persistent id `('storage', <storage type>, key, location, numel)`.

The pickle is read by the restricted unpickler of `zerosafe.formats.torch_pickle` (no code
runs, no tensor byte is read); this module is the zip container: directory, records, CRCs,
lazy reads. Zip format:
https://pkware.cachefly.net/webdocs/casestudies/APPNOTE.TXT
"""

from __future__ import annotations

import bisect
import io
import logging
import struct
import threading
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

from zerosafe.dtypes import dtype_info
from zerosafe.errors import CheckpointFormatError, IntegrityError
from zerosafe.formats.torch_pickle import (  # noqa: F401  (re-exported: the records are read from here)
    ALLOWED_GLOBALS,
    DTypeToken,
    InertObject,
    RestrictedUnpickler,
    StorageRef,
    TensorRecord,
    TorchDevice,
    TorchSize,
    contiguous_stride,
)
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
        unpickler = RestrictedUnpickler(data, self.url)
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
