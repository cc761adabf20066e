"""Streaming safetensors writer: the header first (every shape is known from the plan), then
each tensor's bytes in order, never a whole tensor in memory.

Format (https://github.com/huggingface/safetensors#format): 8 bytes little-endian header
length N, N bytes of UTF-8 JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}`, then the data. We pad the JSON with spaces so the data starts
8-byte aligned, as the reference implementation does, and lay tensors out in the order given.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zerosafe.dtypes import dtype_info
from zerosafe.errors import CheckpointFormatError
from zerosafe.io.storage import ByteSource, Sink
from zerosafe.verify.checksum import new_digest

__all__ = [
    "HeaderEntry",
    "SafetensorsStreamWriter",
    "build_header",
    "read_header",
]

_MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    name: str
    dtype: str
    """torch name (`bfloat16`)."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = dtype_info(self.dtype).itemsize
        for s in self.shape:
            n *= s
        return n


def build_header(entries: Sequence[HeaderEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length prefix plus the padded JSON header for `entries`, in order."""
    header: dict[str, object] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for entry in entries:
        if entry.name in header:
            raise ValueError(f"tensor name '{entry.name}' given twice")
        code = dtype_info(entry.dtype).safetensors_code
        if code is None:
            raise ValueError(
                f"dtype '{entry.dtype}' of '{entry.name}' cannot be stored in safetensors"
            )
        end = offset + entry.nbytes
        header[entry.name] = {
            "dtype": code,
            "shape": list(entry.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * ((8 - (8 + len(raw)) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_header(source: ByteSource) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """Parse a safetensors header: `(tensors, metadata, data_start)`.

    Used by the engine to read its own intermediate files; `zerosafe.verify.tensors` reads outputs with
    the `safetensors` library and a parser of its own instead.
    """
    if source.size_bytes < 8:
        raise CheckpointFormatError(f"{source.url}: too short to be a safetensors file")
    (length,) = struct.unpack("<Q", source.read_range(0, 8))
    if length > _MAX_HEADER_BYTES or 8 + length > source.size_bytes:
        raise CheckpointFormatError(
            f"{source.url}: header length {length} is invalid; file truncated?"
        )
    try:
        header = json.loads(source.read_range(8, 8 + length))
    except ValueError as e:
        raise CheckpointFormatError(f"{source.url}: header is not valid JSON: {e}") from e
    metadata = header.pop("__metadata__", {}) or {}
    data_start = 8 + length
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if data_start + end > source.size_bytes:
        raise CheckpointFormatError(
            f"{source.url}: data ends at {data_start + end} but the file has {source.size_bytes} bytes; truncated"
        )
    return header, metadata, data_start


class SafetensorsStreamWriter:
    """Writes one safetensors file through a `Sink`: header now, tensor bytes as they come.

    Tracks a digest per tensor while writing (`checksum`: SHA-256 unless told), and a CRC32 when `track_crc` (intermediates,
    whose readers check their pieces against it). `write` takes the bytes of tensor `index`
    in order; `finish` checks every tensor got exactly its bytes, then commits.
    """

    def __init__(
        self,
        sink: Sink,
        entries: Sequence[HeaderEntry],
        metadata: dict[str, str] | None = None,
        *,
        track_crc: bool = True,
        checksum: str = "sha256",
    ):
        self.sink = sink
        self._track_crc = track_crc
        self.checksum = checksum
        """The per-tensor digest's algorithm (`zerosafe.verify.checksum`)."""
        self.entries = list(entries)
        self.header = build_header(self.entries, metadata)
        self.digests: list[str] = []
        """Per tensor, in header order, the hex digest of its bytes."""
        self.crc32: list[int] = []
        self._index = 0
        self._written = 0
        self._hash = new_digest(checksum)
        self._crc = 0
        self.sink.write(self.header)
        self._skip_empty()

    @property
    def data_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def file_bytes(self) -> int:
        return len(self.header) + self.data_bytes

    @property
    def sha256(self) -> list[str]:
        """Per-tensor SHA-256 digests (a writer made with `checksum="sha256"`)."""
        assert self.checksum == "sha256", f"this writer records {self.checksum}"
        return self.digests

    def _close_tensor(self) -> None:
        self.digests.append(self._hash.hexdigest())
        self.crc32.append(self._crc)
        self._index += 1
        self._written = 0
        self._hash = new_digest(self.checksum)
        self._crc = 0

    def _skip_empty(self) -> None:
        while self._index < len(self.entries) and self.entries[self._index].nbytes == 0:
            self._close_tensor()

    def write(self, index: int, data: memoryview | bytes) -> None:
        """Append bytes of tensor `index` (the current one)."""
        if index != self._index:
            raise AssertionError(f"bytes for tensor {index} while tensor {self._index} is open")
        view = memoryview(data).cast("B")
        entry = self.entries[index]
        if self._written + len(view) > entry.nbytes:
            raise AssertionError(
                f"'{entry.name}': {self._written + len(view)} bytes for {entry.nbytes}"
            )
        self._hash.update(view)
        if self._track_crc:
            self._crc = zlib.crc32(view, self._crc)
        self.sink.write(view)
        self._written += len(view)
        if self._written == entry.nbytes:
            self._close_tensor()
            self._skip_empty()

    def finish(self) -> None:
        """Check completeness and commit the file."""
        if self._index != len(self.entries):
            name = self.entries[self._index].name
            raise AssertionError(f"{self.sink.url}: tensor '{name}' incomplete at finish")
        self.sink.commit()

    def abort(self) -> None:
        self.sink.abort()
