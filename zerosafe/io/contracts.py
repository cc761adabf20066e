"""What the storage layer hands out and counts: the `ByteSource` and `Sink` protocols the
engine reads and writes through, a file's identity, and the I/O counters
(`zerosafe.io.storage` builds them for local paths and fsspec URLs)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from zerosafe.records import Record

__all__ = ["ByteSource", "FileIdentity", "IOCounter", "PositionalSink", "Sink"]


@dataclass
class IOCounter:
    """Counts bytes and requests, shared by every source or sink of one operation.

    Thread-safe: merges read with several threads at once.
    """

    bytes_read: int = 0
    read_requests: int = 0
    bytes_written: int = 0
    read_by_url: dict[str, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_read(self, num_bytes: int, url: str = "") -> None:
        with self._lock:
            self.bytes_read += num_bytes
            self.read_requests += 1
            self.read_by_url[url] = self.read_by_url.get(url, 0) + num_bytes

    def bytes_read_from(self, urls: set[str] | list[str]) -> int:
        """Bytes read from the given files."""
        with self._lock:
            return sum(self.read_by_url.get(u, 0) for u in urls)

    def add_written(self, num_bytes: int) -> None:
        with self._lock:
            self.bytes_written += num_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class FileIdentity(Record):
    """What identifies one version of a file: its URL, size and mtime or ETag (in job keys
    and the manifest's source files as `{url, size_bytes, version}`)."""

    url: str
    size_bytes: int
    version: str
    """mtime in nanoseconds for local files, the ETag (or mtime) for object stores."""


class ByteSource(Protocol):
    """Ranged, random-access reads of one immutable file."""

    url: str
    size_bytes: int

    def read_range(self, start: int, end: int) -> bytes:
        """Return bytes `[start, end)`; fail if the file is shorter."""
        ...

    def readinto_at(self, offset: int, buf: memoryview) -> None:
        """Fill all of `buf` with the bytes at `offset`; fail if the file is shorter."""
        ...

    def close(self) -> None: ...


class Sink(Protocol):
    """A sequential writer whose file becomes visible, whole, only on `commit`."""

    url: str
    bytes_written: int

    def write(self, data: bytes | memoryview) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class PositionalSink(Sink, Protocol):
    """A `Sink` that also writes at given offsets, from several threads at once (a local
    file, with `pwrite`): a merge's streams each fill their own range of one file."""

    def write_at(self, offset: int, data: bytes | memoryview) -> None: ...
