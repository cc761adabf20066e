"""Where the elements of one stored DCP chunk are, inside its `.distcp` file.

torch's `FileSystemWriter` (torch/distributed/checkpoint/filesystem.py, `_write_item`) stores a
chunk in one of two ways, and `_StorageInfo(relative_path, offset, length)` points at it:
- `SerializationFormat.TORCH_SAVE` (the default): bytes `[offset, offset + length)` are one
  complete `torch.save` zip archive of the chunk alone. It is read with zerosafe's lazy zip
  reader through a view of that byte range, so its record offsets become file offsets.
- `SerializationFormat.SAFETENSORS`: after the file's non-tensor values, the rest of the file is
  one safetensors blob holding every chunk the rank wrote, each under its fqn, and `offset`
  is where that blob begins (`length` is the chunk's byte count). The blob's `__metadata__`
  `DCP_SHARDING_INFO` gives each chunk's `saved_offsets`.
  Format: https://github.com/huggingface/safetensors#format
ByteCheckpoint (verl's backend; `metadata.py` describes its `.metadata`) stores a third way:
bytes `[offset, offset + length)` are the chunk tensor's raw storage, and the tensor's pickle
in `all_tensor_metadata` (`StorageInfo.raw_tensor`) gives its storage offset, shape and
strides.

Only headers and pickles are read here (a few hundred bytes per chunk), never tensor data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from zerosafe.dtypes import dtype_info, from_safetensors_code
from zerosafe.errors import CheckpointFormatError, UnsupportedCheckpointError
from zerosafe.formats.torch_pickle import TensorRecord
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import ByteSource

__all__ = ["ByteRangeSource", "StoredChunk", "locate_chunk"]

_ZIP_HEAD = b"PK\x03\x04"
_ZIP_END = b"PK\x05\x06"
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on a header


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredChunk:
    """The stored bytes of one chunk: a run of `numel` elements in one record of a file."""

    record: str
    record_offset: int
    """Absolute file offset of the record's first data byte."""
    record_size_bytes: int
    record_crc32: int
    """0 where there is none (safetensors; torch.save without CRCs)."""
    element_offset: int
    numel: int
    dtype: str
    serialization: str
    """`torch_save`, `safetensors` or `raw` (ByteCheckpoint)."""


class ByteRangeSource:
    """A `ByteSource` over bytes `[offset, offset + length)` of another one.

    Args:
        base: The whole file.
        offset: Where the view starts in it.
        length: The view's size.
        url: The name messages use for the view.
    """

    def __init__(self, base: ByteSource, offset: int, length: int, url: str) -> None:
        self._base = base
        self._offset = offset
        self.size_bytes = length
        self.url = url

    def _check(self, start: int, end: int) -> None:
        if start < 0 or end > self.size_bytes:
            raise CheckpointFormatError(
                f"{self.url}: a read of bytes [{start}, {end}) goes past the chunk's "
                f"{self.size_bytes} bytes; the chunk is not a complete archive"
            )

    def read_range(self, start: int, end: int) -> bytes:
        self._check(start, end)
        return self._base.read_range(self._offset + start, self._offset + end)

    def readinto_at(self, offset: int, buf: memoryview) -> None:
        self._check(offset, offset + len(buf))
        self._base.readinto_at(self._offset + offset, buf)

    def close(self) -> None:
        """The base file stays open: its owner closes it."""


def locate_chunk(
    source: ByteSource,
    *,
    fqn: str,
    offset: int,
    length: int,
    dtype: str,
    chunk_offsets: tuple[int, ...],
    chunk_sizes: tuple[int, ...],
    header_cache: dict[int, dict[str, Any]] | None = None,
    raw_tensor: TensorRecord | None = None,
) -> StoredChunk:
    """Find where a chunk's elements are stored, reading only headers.

    Args:
        source: The `.distcp` file.
        fqn: The tensor's key, for messages and (safetensors) lookup.
        offset: `_StorageInfo.offset`.
        length: `_StorageInfo.length`.
        dtype: The tensor's dtype in the metadata.
        chunk_offsets: The chunk's offsets in the metadata (safetensors cross-check).
        chunk_sizes: The chunk's shape in the metadata.
        header_cache: Safetensors headers already read from this file, by blob offset.
        raw_tensor: ByteCheckpoint: the tensor whose raw storage the bytes are.

    Returns:
        The record and the element run that hold the chunk, row-major.

    Raises:
        CheckpointFormatError: If the file is shorter than the metadata says, the bytes there
            are not a stored chunk, or the chunk disagrees with the metadata.
    """
    where = f"{source.url}: chunk of '{fqn}' at offsets {list(chunk_offsets)}"
    if offset < 0 or length < 0 or offset + length > source.size_bytes:
        raise CheckpointFormatError(
            f"{where}: the metadata places it at bytes [{offset}, {offset + length}) but the "
            f"file has {source.size_bytes} bytes; the file is truncated. Copy it again from the "
            "training run's storage."
        )
    if raw_tensor is not None:
        return _raw_chunk(where, offset, length, dtype, chunk_sizes, raw_tensor)
    head = source.read_range(offset, offset + min(8, length))
    if head.startswith(_ZIP_HEAD):
        return _zip_chunk(source, where, offset, length, dtype, chunk_sizes)
    if len(head) == 8 and 2 <= struct.unpack("<Q", head)[0] <= _MAX_HEADER_BYTES:
        return _safetensors_chunk(
            source, where, fqn, offset, length, dtype, chunk_offsets, chunk_sizes, header_cache
        )
    raise CheckpointFormatError(
        f"{where}: bytes [{offset}, {offset + length}) start with {head!r}, neither a torch.save "
        "archive nor a safetensors blob; the metadata does not match this file (was a "
        ".distcp file replaced by one of another save?)"
    )


def _zip_chunk(
    source: ByteSource,
    where: str,
    offset: int,
    length: int,
    dtype: str,
    sizes: tuple[int, ...],
) -> StoredChunk:
    # torch.save writes no zip comment, so a complete archive ends with its end record.
    tail = source.read_range(offset + length - 22, offset + length) if length >= 22 else b""
    if not tail.startswith(_ZIP_END):
        raise CheckpointFormatError(
            f"{where}: the metadata gives it {length} bytes at offset {offset}, but no "
            "torch.save archive ends there; the chunk's length disagrees with the metadata (the "
            "file was rewritten, or the metadata belongs to another save)"
        )
    view = ByteRangeSource(source, offset, length, f"{where} (bytes {offset}+{length})")
    archive = TorchZipFile(view)
    tensor = archive.load()
    if not isinstance(tensor, TensorRecord):
        raise CheckpointFormatError(
            f"{where}: the archive holds {type(tensor).__name__}, expected one tensor"
        )
    _check_chunk_tensor(where, dtype, sizes, tensor)
    record = archive.storage_record(tensor.storage.key)
    return StoredChunk(
        record=record.name,
        record_offset=offset + archive.data_offset(record),
        record_size_bytes=record.size_bytes,
        record_crc32=record.crc32,
        element_offset=tensor.storage_offset,
        numel=tensor.numel,
        dtype=tensor.dtype,
        serialization="torch_save",
    )


def _check_chunk_tensor(
    where: str, dtype: str, sizes: tuple[int, ...], tensor: TensorRecord
) -> None:
    """A stored chunk's tensor is the metadata's shape and dtype, in row-major order.

    Raises:
        CheckpointFormatError: If its shape or dtype is not the metadata's.
        UnsupportedCheckpointError: If it is not row-major.
    """
    if tensor.shape != sizes or tensor.dtype != dtype:
        raise CheckpointFormatError(
            f"{where}: the stored chunk is {list(tensor.shape)} x {tensor.dtype}, the metadata "
            f"says {list(sizes)} x {dtype}; the metadata belongs to another save"
        )
    if not tensor.is_contiguous():
        raise UnsupportedCheckpointError(
            f"{where}: the chunk was saved with strides {list(tensor.stride)} (not row-major); "
            "zerosafe copies row-major chunks only. Save the state dict with contiguous tensors."
        )


def _raw_chunk(
    where: str,
    offset: int,
    length: int,
    dtype: str,
    sizes: tuple[int, ...],
    tensor: TensorRecord,
) -> StoredChunk:
    # ByteCheckpoint writes `storage.nbytes()` bytes of the chunk's storage (its
    # utilities/serialization.py `_serialize_tensor`), so the storage must fill the range.
    _check_chunk_tensor(where, dtype, sizes, tensor)
    storage_bytes = tensor.storage.numel * dtype_info(tensor.storage.dtype).itemsize
    end = tensor.storage_offset + tensor.numel
    if storage_bytes != length or tensor.storage.dtype != dtype or end > tensor.storage.numel:
        raise CheckpointFormatError(
            f"{where}: the metadata gives it {length} bytes at offset {offset}, but its tensor "
            f"is elements [{tensor.storage_offset}, {end}) of a storage of "
            f"{tensor.storage.numel} x {tensor.storage.dtype}; the chunk's length disagrees "
            "with the metadata (the file was rewritten, or the metadata belongs to another save)"
        )
    return StoredChunk(
        record=f"bytes {offset}+{length}",
        record_offset=offset,
        record_size_bytes=length,
        record_crc32=0,
        element_offset=tensor.storage_offset,
        numel=tensor.numel,
        dtype=dtype,
        serialization="raw",
    )


def _safetensors_header(
    source: ByteSource, where: str, offset: int, cache: dict[int, dict[str, Any]] | None
) -> dict[str, Any]:
    if cache is not None and offset in cache:
        return cache[offset]
    (n,) = struct.unpack("<Q", source.read_range(offset, offset + 8))
    if offset + 8 + n > source.size_bytes:
        raise CheckpointFormatError(
            f"{where}: its safetensors header ({n} bytes) runs past the end of the file "
            f"({source.size_bytes} bytes); the file is truncated"
        )
    try:
        header = json.loads(source.read_range(offset + 8, offset + 8 + n))
    except ValueError as e:
        raise CheckpointFormatError(f"{where}: the safetensors header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{where}: the safetensors header is not a JSON object")
    header["__data_start__"] = offset + 8 + n
    if cache is not None:
        cache[offset] = header
    return header


def _safetensors_chunk(
    source: ByteSource,
    where: str,
    fqn: str,
    offset: int,
    length: int,
    dtype: str,
    chunk_offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    cache: dict[int, dict[str, Any]] | None,
) -> StoredChunk:
    header = _safetensors_header(source, where, offset, cache)
    entry = header.get(fqn)
    if not isinstance(entry, dict):
        raise CheckpointFormatError(
            f"{where}: the safetensors blob at offset {offset} has no tensor '{fqn}'; the "
            "metadata belongs to another save"
        )
    saved = _saved_offsets(header, fqn)
    if saved is not None and tuple(saved) != chunk_offsets:
        raise CheckpointFormatError(
            f"{where}: the blob's '{fqn}' was saved at offsets {list(saved)}, not "
            f"{list(chunk_offsets)}; zerosafe reads one chunk per tensor per file"
        )
    begin, end = entry["data_offsets"]
    stored_dtype = from_safetensors_code(entry["dtype"]).name
    if tuple(entry["shape"]) != sizes or stored_dtype != dtype:
        raise CheckpointFormatError(
            f"{where}: the stored chunk is {entry['shape']} x {stored_dtype}, the metadata says "
            f"{list(sizes)} x {dtype}; the metadata belongs to another save"
        )
    numel = 1
    for s in sizes:
        numel *= s
    if end - begin != length or length != numel * dtype_info(dtype).itemsize:
        raise CheckpointFormatError(
            f"{where}: the metadata gives it {length} bytes, the safetensors header "
            f"{end - begin}, and {list(sizes)} x {dtype} needs "
            f"{numel * dtype_info(dtype).itemsize}; the chunk's length disagrees with the metadata"
        )
    start = int(header["__data_start__"]) + int(begin)
    if start + length > source.size_bytes:
        raise CheckpointFormatError(
            f"{where}: its bytes [{start}, {start + length}) run past the end of the file "
            f"({source.size_bytes} bytes); the file is truncated"
        )
    return StoredChunk(
        record=fqn,
        record_offset=start,
        record_size_bytes=length,
        record_crc32=0,
        element_offset=0,
        numel=numel,
        dtype=dtype,
        serialization="safetensors",
    )


def _saved_offsets(header: dict[str, Any], fqn: str) -> list[int] | None:
    meta = header.get("__metadata__") or {}
    raw = meta.get("DCP_SHARDING_INFO")
    if raw is None:
        return None
    try:
        info = json.loads(raw)
        return list(info[fqn]["saved_offsets"])
    except (ValueError, KeyError, TypeError):
        return None
