"""A local output file's writes: a merge's streams (`LocalSink.write_at`) start the kernel's
writeback early, as a sequential `write` does, so the commit's fsync is left little to do."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from zerosafe.io import residency, storage
from zerosafe.io.storage import LocalSink

BLOCK = 2**20


def _dirty_pages(path: Path) -> int | None:
    """Pages of `path` the page cache holds dirty (`cachestat`), or None where it cannot say."""
    libc = residency._libc()
    if libc is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        span, stat = residency._Range(0, path.stat().st_size), residency._Stat()
        if libc.syscall(residency._SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0):
            return None
        return int(stat.dirty)
    finally:
        os.close(fd)


def test_writes_at_offsets_start_writeback_as_they_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage, "_WRITEBACK_BYTES", BLOCK)
    blocks, data = 16, os.urandom(BLOCK)
    control = tmp_path / "control.bin"  # the same writes, with nothing asking for writeback
    fd = os.open(control, os.O_WRONLY | os.O_CREAT, 0o600)
    for n in range(blocks // 2):  # two ranges filled side by side, as two streams do
        os.pwrite(fd, data, n * BLOCK)
        os.pwrite(fd, data, (blocks // 2 + n) * BLOCK)
    os.close(fd)
    dirty = _dirty_pages(control)
    pages = blocks * BLOCK // os.sysconf("SC_PAGE_SIZE")
    if dirty is None or storage._sync_file_range is None or dirty < pages // 2:
        pytest.skip("this file system or kernel does not show dirty pages waiting (cachestat)")
    sink = LocalSink(str(tmp_path / "out.bin"))
    for n in range(blocks // 2):
        sink.write_at(n * BLOCK, data)
        sink.write_at((blocks // 2 + n) * BLOCK, data)
    written = Path(sink._tmp_path)
    assert sink.bytes_written == blocks * BLOCK
    still = _dirty_pages(written)
    assert still is not None and still <= pages // 4, (still, pages)
    sink.commit()
    assert (tmp_path / "out.bin").read_bytes() == data * blocks
