"""torch's zip container, streamed: stored records, 64-byte aligned, CRC-32 per record, ZIP64."""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

# zip's CRC-32 of a concatenation and of a run of zeros (holes, padding), in O(log n)
from zerosafe.formats.crc import crc32_combine, crc32_zeros

ZIP64_LIMIT = 0xFFFFFFFF
"""Sizes and offsets at or above this are written as ZIP64 fields (the 32-bit field holds 0xFFFFFFFF)."""


@dataclass
class _Entry:
    name: bytes
    offset: int
    size: int
    zip64: bool
    crc: int = 0
    done: int = 0


class ZipWriter:
    """Writes a zip the way torch.save lays it out: stored records, data 64-byte aligned (an
    'FB' padding extra field), CRC and sizes in a data descriptor after each record (flag 0x0808),
    then the central directory, a ZIP64 end record and locator, and the end record. Entries or
    offsets at or above `zip64_threshold` get ZIP64 fields. Records are streamed: chunks, or
    holes (sparse zeros), with the CRC combined as they go."""

    def __init__(self, path: str, zip64_threshold: int = ZIP64_LIMIT) -> None:
        self.path = path
        self.thr = zip64_threshold
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0
        self.written = 0
        self.entries: list[_Entry] = []
        self.cur: _Entry | None = None

    def _write(self, data: bytes | memoryview) -> None:
        mv = memoryview(data).cast("B")
        while mv:
            n = os.write(self.fd, mv)
            mv = mv[n:]
            self.pos += n
            self.written += n

    def begin(self, name: str, size: int) -> None:
        assert self.cur is None
        name_b = name.encode()
        zip64 = size >= self.thr
        extra = struct.pack("<HHQQ", 1, 16, 0, 0) if zip64 else b""
        header_len = 30 + len(name_b) + len(extra) + 4
        pad = (-(self.pos + header_len)) % 64
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        sizes = 0xFFFFFFFF if zip64 else 0
        local = struct.pack(
            "<IHHHHHIIIHH",
            0x04034B50,
            45 if zip64 else 0,
            0x0808,
            0,
            0,
            0,
            0,
            sizes,
            sizes,
            len(name_b),
            len(extra),
        )
        self.cur = _Entry(name_b, self.pos, size, zip64)
        self._write(local + name_b + extra)
        assert self.pos % 64 == 0

    def data(self, chunk: memoryview | bytes, crc: int | None = None) -> None:
        cur = self.cur
        assert cur is not None
        n = memoryview(chunk).nbytes
        if crc is None:
            crc = zlib.crc32(chunk)
        cur.crc = crc32_combine(cur.crc, crc, n) if cur.done else crc
        cur.done += n
        self._write(chunk)

    def hole(self, nbytes: int) -> None:
        """`nbytes` zeros, as a sparse hole (seek past them)."""
        cur = self.cur
        assert cur is not None
        os.lseek(self.fd, nbytes, os.SEEK_CUR)
        self.pos += nbytes
        cur.crc = crc32_zeros(nbytes, cur.crc)
        cur.done += nbytes

    def end(self) -> None:
        cur = self.cur
        assert cur is not None
        if cur.done != cur.size:
            raise RuntimeError(
                f"{self.path}: record {cur.name.decode()} got {cur.done} bytes, expected {cur.size}"
            )
        if cur.zip64:
            dd = struct.pack("<IIQQ", 0x08074B50, cur.crc, cur.size, cur.size)
        else:
            dd = struct.pack("<IIII", 0x08074B50, cur.crc, cur.size, cur.size)
        self._write(dd)
        self.entries.append(cur)
        self.cur = None

    def add(self, name: str, data: bytes) -> None:
        self.begin(name, len(data))
        if data:
            self.data(data)
        self.end()

    def close(self) -> None:
        """Write the central directory and the end records, and close the file."""
        cd_start = self.pos
        self._write(b"".join(self._central_record(e) for e in self.entries))
        self._write(self._end_records(cd_start, self.pos - cd_start))
        os.close(self.fd)
        self.fd = -1

    def _central_record(self, e: _Entry) -> bytes:
        """An entry's central directory header, its name and its ZIP64 extra field if needed."""
        fields = []
        size32 = e.size
        off32 = e.offset
        if e.size >= self.thr:
            fields += [e.size, e.size]
            size32 = 0xFFFFFFFF
        if e.offset >= self.thr:
            fields.append(e.offset)
            off32 = 0xFFFFFFFF
        extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
        header = struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            0,
            45 if fields else 0,
            0x0808,
            0,
            0,
            0,
            e.crc,
            size32,
            size32,
            len(e.name),
            len(extra),
            0,
            0,
            0,
            0,
            off32,
        )
        return header + e.name + extra

    def _end_records(self, cd_start: int, cd_size: int) -> bytes:
        """The ZIP64 end of central directory record and locator (always, as torch writes them),
        then the end record with 0xFFFFFFFF where a value does not fit."""
        n = len(self.entries)
        eocd64 = self.pos
        tail = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n, cd_size, cd_start)
        tail += struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1)
        tail += struct.pack(
            "<IHHHHIIH",
            0x06054B50,
            0,
            0,
            min(n, 0xFFFF),
            min(n, 0xFFFF),
            cd_size if cd_size < self.thr else 0xFFFFFFFF,
            cd_start if cd_start < self.thr else 0xFFFFFFFF,
            0,
        )
        return tail

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
