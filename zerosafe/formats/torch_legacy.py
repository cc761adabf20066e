"""Legacy (non-zip) `torch.save` files, read lazily and without running code.

torch writes this format with `_use_new_zipfile_serialization=False`, and DeepSpeed with
`checkpoint: {checkpoint_serialization: false}`. The file is a sequence of pickles followed by
the raw storages (docs/formats.md, "Legacy torch files"):

1. the magic number `0x1950a86a20f9469cfc6c`, 2. the protocol version `1001`, 3. `sys_info`
(`little_endian`, type sizes), 4. the object, whose storages are persistent ids
`('storage', <storage type>, key, location, numel, view_metadata)`, 5. the list of storage
keys in the order their data follows, 6. per key: the element count as a little-endian
int64, then the elements.

Every pickle goes through the same restricted unpickler as the zip format's; no byte of
tensor data is read here. The storages' offsets come from walking the count fields (one
8-byte read each, checked against the counts the pickle names), so a mismatch is a clear
error, never a shifted read. The format has no checksums: the records' CRC is 0 ("none").
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

from zerosafe.dtypes import dtype_info
from zerosafe.errors import CheckpointFormatError, ConversionError, IntegrityError
from zerosafe.formats.torch_pickle import RestrictedUnpickler, StorageRef
from zerosafe.formats.torch_zip import TorchZipFile, ZipRecord
from zerosafe.io.storage import ByteSource

__all__ = ["LEGACY_MAGIC", "LegacyTorchFile", "is_legacy_head", "open_torch_file"]

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
_COUNT = struct.Struct("<q")
_FIRST_READ = 1 << 20


def is_legacy_head(head: bytes) -> bool:
    """Whether a file's first bytes are a legacy torch file's: a protocol-2 pickle of the
    magic number (a LONG1 opcode)."""
    return head.startswith(b"\x80\x02\x8a\x0a")


def open_torch_file(source: ByteSource) -> TorchZipFile:
    """The zip-format or legacy reader for a `torch.save` file, by its first bytes."""
    head = source.read_range(0, min(4, source.size_bytes))
    if is_legacy_head(head):
        return LegacyTorchFile(source)
    return TorchZipFile(source)


class _LegacyUnpickler(RestrictedUnpickler):
    """The object pickle: storages carry a sixth field, `view_metadata` (None since torch
    0.4; older files share storages between views, which is refused)."""

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage":
            if pid[5] is not None:
                raise CheckpointFormatError(
                    f"{self._url}: storage '{pid[2]}' is a view of another storage (torch < 0.4 "
                    "files); re-save the file with a current torch"
                )
            pid = pid[:5]
        return super().persistent_load(pid)


class LegacyTorchFile(TorchZipFile):
    """A legacy torch file behind `TorchZipFile`'s interface: one pseudo record per storage
    (`legacy/<key>`, at its count field, without CRC), and `data.pkl` for the pickles."""

    def __init__(self, source: ByteSource) -> None:  # noqa: D107 - no zip directory to read
        self.source = source
        self.url = source.url
        self.prefix = ""
        self.globals_found: set[str] = set()
        self.storages: dict[str, StorageRef] = {}
        self.records: dict[str, ZipRecord] = {}
        self._data_offsets: dict[str, int] = {}
        self._directory_start = source.size_bytes
        self._obj: Any = None
        self._keys: list[str] = []
        self._parse_head()

    def _parse_head(self) -> None:
        """Parse the pickles at the file's head, reading a larger prefix until they fit."""
        size = self.source.size_bytes
        want = min(size, _FIRST_READ)
        while True:
            head = self.source.read_range(0, want)
            try:
                head_end = self._parse_pickles(io.BytesIO(head))
                break
            except ConversionError:
                raise
            except (EOFError, pickle.UnpicklingError, ValueError) as e:
                if want >= size:
                    raise CheckpointFormatError(
                        f"{self.url}: a legacy torch file whose pickles end early or are "
                        f"damaged ({e}); the file is truncated or corrupt"
                    ) from e
                want = min(size, want * 4)
        self.records["data.pkl"] = ZipRecord(
            name="data.pkl", header_offset=0, size_bytes=head_end, crc32=0
        )
        self._locate_storages(head_end)

    def _parse_pickles(self, stream: io.BytesIO) -> int:
        """The five pickles; returns where the storages' data begins."""
        magic = self._plain(stream, "the magic number")
        protocol = self._plain(stream, "the protocol version")
        sys_info = self._plain(stream, "sys_info")
        if magic != LEGACY_MAGIC or protocol != LEGACY_PROTOCOL:
            raise CheckpointFormatError(
                f"{self.url}: starts like a legacy torch file but its magic number or "
                f"protocol ({magic!r}, {protocol!r}) is not torch's; not a torch.save file"
            )
        if not isinstance(sys_info, dict) or sys_info.get("little_endian") is not True:
            raise CheckpointFormatError(
                f"{self.url}: saved on a big-endian machine or without sys_info; zerosafe "
                "reads little-endian files. Re-save it with torch on a little-endian machine."
            )
        unpickler = _LegacyUnpickler(stream, self.url)
        obj = unpickler.load()
        keys = self._plain(stream, "the storage keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise CheckpointFormatError(f"{self.url}: the storage key list is not a list of names")
        self._obj, self._keys = obj, keys
        self.globals_found = set(unpickler.globals_found)
        self.storages = dict(unpickler.storages)
        return stream.tell()

    def _plain(self, stream: io.BytesIO, what: str) -> Any:
        """A bookkeeping pickle (numbers, a dict, a list of names): no globals at all."""
        unpickler = RestrictedUnpickler(stream, f"{self.url} ({what})")
        return unpickler.load()

    def _locate_storages(self, pos: int) -> None:
        """Walk the count fields after the pickles: every storage's data offset."""
        for key in self._keys:
            ref = self.storages.get(key)
            if ref is None:
                raise CheckpointFormatError(
                    f"{self.url}: storage '{key}' has data in the file but the pickle never "
                    "names it; the file is corrupt"
                )
            nbytes = ref.numel * dtype_info(ref.dtype).itemsize
            if pos + _COUNT.size + nbytes > self.source.size_bytes:
                raise CheckpointFormatError(
                    f"{self.url}: storage '{key}' ({nbytes} bytes at offset {pos + _COUNT.size}) "
                    f"runs past the end of the file ({self.source.size_bytes} bytes); the file "
                    "is truncated"
                )
            (count,) = _COUNT.unpack(self.source.read_range(pos, pos + _COUNT.size))
            if count != ref.numel:
                raise CheckpointFormatError(
                    f"{self.url}: storage '{key}' holds {count} elements where the pickle names "
                    f"{ref.numel}; the file is corrupt"
                )
            name = f"legacy/{key}"
            self.records[name] = ZipRecord(name=name, header_offset=pos, size_bytes=nbytes, crc32=0)
            self._data_offsets[name] = pos + _COUNT.size
            pos += _COUNT.size + nbytes
        missing = sorted(set(self.storages) - set(self._keys))
        if missing:
            raise CheckpointFormatError(
                f"{self.url}: the pickle names storage(s) {missing[:4]} whose data is not in the "
                "file; the file is truncated or corrupt"
            )
        self._directory_start = pos

    # -- TorchZipFile's interface ------------------------------------------------------------

    def storage_record(self, key: str) -> ZipRecord:
        try:
            return self.records[f"legacy/{key}"]
        except KeyError:
            raise CheckpointFormatError(
                f"{self.url}: the pickle names storage '{key}' but the file holds no data for "
                "it; the file is corrupt"
            ) from None

    def data_offset(self, record: ZipRecord) -> int:
        return self._data_offsets[record.name]

    @property
    def directory_bytes(self) -> int:
        return 0

    def read_record(self, record: ZipRecord, *, check_crc: bool = True) -> bytes:
        if record.name == "data.pkl":
            return self.source.read_range(0, record.size_bytes)
        start = self.data_offset(record)
        data = self.source.read_range(start, start + record.size_bytes)
        if len(data) != record.size_bytes:
            raise IntegrityError(f"{self.url}: short read of storage '{record.name}'")
        return data

    def load(self) -> Any:
        return self._obj
