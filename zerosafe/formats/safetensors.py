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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from zerosafe.dtypes import dtype_info
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.crc import crc32 as _crc32
from zerosafe.io.storage import ByteSource, Sink
from zerosafe.verify.checksum import new_digest

__all__ = [
    "HeaderEntry",
    "SafetensorsHeader",
    "SafetensorsStreamWriter",
    "StoredEntry",
    "TensorRangeWriter",
    "build_header",
    "read_entries",
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


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """One tensor of a safetensors header as stored: where its bytes are."""

    dtype: str
    """The safetensors code (`BF16`)."""
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]
    """`(begin, end)` in the data region."""

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


SafetensorsHeader = dict[str, StoredEntry]
"""Tensor name -> its entry, in the header's order."""


def read_entries(source: ByteSource) -> tuple[SafetensorsHeader, dict[str, str], int]:
    """`read_header` with every entry typed: `(entries, metadata, data_start)`.

    Raises:
        CheckpointFormatError: As `read_header`, or where an entry is not `{dtype, shape,
            data_offsets: [begin, end]}`.
    """
    try:
        header, metadata, data_start = read_header(source)
        entries = {
            name: StoredEntry(
                str(e["dtype"]),
                tuple(int(s) for s in e["shape"]),
                (int(e["data_offsets"][0]), int(e["data_offsets"][1])),
            )
            for name, e in header.items()
        }
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
        if isinstance(e, CheckpointFormatError):
            raise
        raise CheckpointFormatError(
            f"{source.url}: a header entry is not {{dtype, shape, data_offsets}} "
            f"({type(e).__name__}: {e}); the file is corrupt or not a safetensors file"
        ) from e
    return entries, metadata, data_start


class _TensorCursor:
    """Which tensor of `entries[first:last]` the next bytes belong to, and each finished
    tensor's digest (and CRC32 when `track_crc`), for the writers below."""

    def __init__(
        self,
        entries: Sequence[HeaderEntry],
        first: int,
        last: int,
        *,
        checksum: str,
        track_crc: bool,
    ) -> None:
        self.entries = list(entries)
        self.checksum = checksum
        """The per-tensor digest's algorithm (`zerosafe.verify.checksum`)."""
        self.digests: list[str] = []
        """Per tensor, in header order, the hex digest of its bytes."""
        self.crc32: list[int] = []
        self._track_crc = track_crc
        self._index = first
        self._last = last
        self._written = 0
        self._hash = new_digest(checksum)
        self._crc = 0
        self._skip_empty()

    def _close_tensor(self) -> None:
        self.digests.append(self._hash.hexdigest())
        self.crc32.append(self._crc)
        self._index += 1
        self._written = 0
        self._hash = new_digest(self.checksum)
        self._crc = 0

    def _skip_empty(self) -> None:
        while self._index < self._last and self.entries[self._index].nbytes == 0:
            self._close_tensor()

    def _take(self, index: int, data: memoryview | bytes) -> memoryview:
        """`data` as the next bytes of tensor `index` (the current one): checked and hashed;
        the caller writes them, then calls `_taken`."""
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
            self._crc = _crc32(view, self._crc)
        return view

    def _taken(self, nbytes: int) -> None:
        self._written += nbytes
        if self._written == self.entries[self._index].nbytes:
            self._close_tensor()
            self._skip_empty()

    @property
    def complete(self) -> bool:
        """Whether every tensor of the range got all its bytes."""
        return self._index == self._last


class SafetensorsStreamWriter(_TensorCursor):
    """Writes one safetensors file through a `Sink`: header now, tensor bytes as they come.

    Tracks a digest per tensor while writing (`checksum`: SHA-256 unless told), and a CRC32 when `track_crc` (intermediates,
    whose readers check their pieces against it). `write` takes the bytes of tensor `index`
    in order; `finish` checks every tensor got exactly its bytes, then commits. Several
    threads may instead fill the tensors in ranges (`ranges`, then `adopt`).
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
        self.header = build_header(entries, metadata)
        self.sink.write(self.header)
        super().__init__(entries, 0, len(entries), checksum=checksum, track_crc=track_crc)

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

    def write(self, index: int, data: memoryview | bytes) -> None:
        """Append bytes of tensor `index` (the current one)."""
        view = self._take(index, data)
        self.sink.write(view)
        self._taken(len(view))

    def ranges(
        self, bounds: Sequence[int], write_at: Callable[[int, memoryview], None]
    ) -> list[TensorRangeWriter]:
        """Writers of tensors `[bounds[i], bounds[i + 1])` at their own offsets of the file,
        through `write_at` (a local sink's `write_at`), one per thread; no tensor may have been
        written here. `adopt` takes their digests back once all are complete."""
        if self._written or any(e.nbytes for e in self.entries[: self._index]):
            raise AssertionError("ranges of a file whose tensors have begun")
        if not bounds or bounds[0] != 0 or bounds[-1] != len(self.entries):
            raise AssertionError(f"ranges {list(bounds)} do not cover {len(self.entries)} tensors")
        start = len(self.header)
        offsets = [start]
        for entry in self.entries:
            offsets.append(offsets[-1] + entry.nbytes)
        return [
            TensorRangeWriter(self, first, last, offsets[first], write_at)
            for first, last in zip(bounds, bounds[1:], strict=False)
        ]

    def adopt(self, parts: Sequence[TensorRangeWriter]) -> None:
        """Every tensor as `parts` (from `ranges`, in order) wrote it."""
        incomplete = [p for p in parts if not p.complete]
        if incomplete:
            raise AssertionError(f"tensor range {incomplete[0].first} incomplete at adopt")
        self.digests = [d for p in parts for d in p.digests]
        self.crc32 = [c for p in parts for c in p.crc32]
        if len(self.digests) != len(self.entries):
            raise AssertionError(f"{len(self.digests)} tensors adopted of {len(self.entries)}")
        self._index = len(self.entries)

    def finish(self) -> None:
        """Check completeness and commit the file."""
        if self._index != len(self.entries):
            name = self.entries[self._index].name
            raise AssertionError(f"{self.sink.url}: tensor '{name}' incomplete at finish")
        self.sink.commit()

    def abort(self) -> None:
        self.sink.abort()


class TensorRangeWriter(_TensorCursor):
    """Tensors `[first, last)` of a file a `SafetensorsStreamWriter` began, written at their
    own offsets (`SafetensorsStreamWriter.ranges`)."""

    def __init__(
        self,
        parent: SafetensorsStreamWriter,
        first: int,
        last: int,
        offset: int,
        write_at: Callable[[int, memoryview], None],
    ) -> None:
        self.sink = parent.sink
        self.first = first
        self._pos = offset
        self._write_at = write_at
        super().__init__(
            parent.entries, first, last, checksum=parent.checksum, track_crc=parent._track_crc
        )

    def write(self, index: int, data: memoryview | bytes) -> None:
        """Bytes of tensor `index` (the range's current one), at the next offset."""
        view = self._take(index, data)
        self._write_at(self._pos, view)
        self._pos += len(view)
        self._taken(len(view))
