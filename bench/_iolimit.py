"""The I/O limit of a conversion, and page-cache control for warm and cold runs.

The limit is what no converter can beat on this machine: reading the fp32 master bytes once
(exactly the records the plan reads: every rank's flat fp32 partitions, not the moments) plus
writing the output's bytes once to a fresh file and making them durable (`fsync`, as
zerosafe's writer does). It is measured two ways:

- `serial`: read everything, then write everything; the issue's definition (read + write).
  The write is timed twice, plainly and with early writeback (`sync_file_range` every
  64 MiB), and the faster counts: on this machine a plain writer is throttled once about
  0.5 GB is dirty, and the limit is what the device can do, not what one way of writing gets.
- `overlapped`: the same reads and an early-writeback write at once, in separate threads:
  the best a pipelined converter could do if the device serves reads and writes in parallel.

Cold runs use `posix_fadvise(POSIX_FADV_DONTNEED)` on the files read (after `fdatasync`, so no
page is left dirty and undroppable); nothing system-wide is dropped. `residency` reports how
much of a file is in the page cache (`fincore` from util-linux), to show the drop worked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable
from typing import Any

__all__ = [
    "drop_cache",
    "fp32_ranges",
    "measure_limit",
    "plan_ranges",
    "residency",
    "warm_cache",
]

_CHUNK = 16 * 2**20
_SEEK_DATA, _SEEK_HOLE = 3, 4  # lseek whence values on Linux


def fp32_ranges(ckpt_dir: str, tag: str | None = None) -> tuple[list[tuple[str, int, int]], int]:
    """`([(path, offset, nbytes)], fp32 bytes)`: the fp32 master records, merged and sorted.

    Uses zerosafe's own reader and plan, which only parse the pickles and zip directories.
    """
    from zerosafe.config import ConvertOptions
    from zerosafe.formats.deepspeed.checkpoint import build_plan, open_zero_checkpoint
    from zerosafe.io.storage import Storage

    plan = build_plan(open_zero_checkpoint(Storage(), ckpt_dir, tag=tag), ConvertOptions())
    spans = sorted(
        (plan.files[s.file].url, s.byte_offset, s.nbytes) for s in plan.slots if s.kind == "fp32"
    )
    merged: list[tuple[str, int, int]] = []
    for path, off, n in spans:
        if merged and merged[-1][0] == path and merged[-1][1] + merged[-1][2] == off:
            merged[-1] = (path, merged[-1][1], merged[-1][2] + n)
        else:
            merged.append((path, off, n))
    return merged, sum(n for _, _, n in spans)


def plan_ranges(ckpt: str, *, dtype: str) -> tuple[list[tuple[str, int, int]], int, int]:
    """`([(path, offset, nbytes)], their total, output bytes)`: the byte ranges a conversion of
    `ckpt` to `dtype` reads (zerosafe's plan of any format it reads: only metadata and headers
    are parsed) and the bytes it writes."""
    from zerosafe.config import ConvertOptions
    from zerosafe.io.storage import Storage
    from zerosafe.plan.build import plan_checkpoint

    _, plan = plan_checkpoint(Storage(), ckpt, tag=None, options=ConvertOptions(dtype=dtype))
    ranges = [(plan.files[s.file].url, s.byte_offset, s.nbytes) for s in plan.slots]
    return ranges, sum(n for _, _, n in ranges), plan.total_out_bytes


def _data_extents(fd: int, size: int) -> Iterable[tuple[int, int]]:
    """(offset, length) of the parts of a (sparse) file that hold data."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, _SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            return
        end = os.lseek(fd, start, _SEEK_HOLE)
        yield start, end - start
        pos = end


def warm_cache(paths: Iterable[str]) -> int:
    """Read every data extent of `paths` (holes skipped) so they sit in the page cache."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            for start, length in list(_data_extents(fd, os.fstat(fd).st_size)):
                pos = start
                while pos < start + length:
                    n = os.preadv(fd, [view[: min(_CHUNK, start + length - pos)]], pos)
                    if n <= 0:
                        break
                    pos += n
                    total += n
        finally:
            os.close(fd)
    return total


def drop_cache(paths: Iterable[str]) -> None:
    """Evict `paths` from the page cache (only these files; nothing system-wide)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def residency(paths: Iterable[str]) -> int | None:
    """Bytes of `paths` resident in the page cache, or None without `fincore`."""
    paths = list(paths)
    if not paths or shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *paths],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return None
    return sum(int(x) for x in out.stdout.split())


def _read_ranges(ranges: list[tuple[str, int, int]], threads: int) -> int:
    """Read the ranges with `threads` threads (a file at a time each); returns bytes read."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for path, off, n in ranges:
        by_file.setdefault(path, []).append((off, n))
    files = sorted(by_file)
    lock = threading.Lock()
    counts: list[int] = []

    def worker() -> None:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        got = 0
        while True:
            with lock:
                if not files:
                    break
                path = files.pop(0)
            fd = os.open(path, os.O_RDONLY)
            try:
                for off, n in by_file[path]:
                    pos = off
                    while pos < off + n:
                        k = os.preadv(fd, [view[: min(_CHUNK, off + n - pos)]], pos)
                        if k <= 0:
                            raise OSError(f"{path}: short read at {pos}")
                        pos += k
                        got += k
            finally:
                os.close(fd)
        with lock:
            counts.append(got)

    pool = [threading.Thread(target=worker) for _ in range(max(1, threads))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(counts)


_WRITEBACK_BYTES = 64 * 2**20
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Any:
    """libc's `sync_file_range` (Linux), or None."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        return fn
    except (OSError, AttributeError):
        return None


def _write_file(path: str, nbytes: int, *, early_writeback: bool = False) -> None:
    """Write `nbytes` to a new file and fsync it.

    `early_writeback`: start writeback of every 64 MiB as soon as it is written
    (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which does not wait). Measured here, a plain
    writer is throttled to about 0.4 GB/s once ~0.5 GB is dirty, while the device takes far
    more when writeback starts early; the limit takes the faster of the two.
    """
    # Incompressible-looking, non-zero data: a fixed pattern that no layer can dedupe cheaply.
    block = bytearray(os.urandom(1 << 20)) * (_CHUNK >> 20)
    view = memoryview(block)
    start_writeback = _sync_file_range() if early_writeback else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = flushed = 0
        while done < nbytes:
            done += os.write(fd, view[: min(_CHUNK, nbytes - done)])
            if start_writeback is not None and done - flushed >= _WRITEBACK_BYTES:
                start_writeback(fd, flushed, done - flushed, _SYNC_FILE_RANGE_WRITE)
                flushed = done
        os.fsync(fd)
    finally:
        os.close(fd)


def measure_limit(
    ranges: list[tuple[str, int, int]],
    out_dir: str,
    out_bytes: int,
    *,
    overlapped: bool = False,
    threads: int = 2,
    writers: int = 1,
) -> dict[str, Any]:
    """Time reading `ranges` once and writing `out_bytes` once (fsynced) into `out_dir`.

    Serial: the read, then the write twice (plain, and with early writeback), each timed
    alone; `write_s` is the faster and `total_s = read_s + write_s`. Overlapped: the read and
    the early-writeback write at once, the write cut into `writers` files written by as many
    threads (a conversion of N tasks writes N shards at once; one stream understated a 16-core
    machine, whose 8 worker processes beat it); `total_s` runs until both finished.
    """
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "io-limit.bin")
    paths = [path] if writers <= 1 else [f"{path}.{i}" for i in range(writers)]
    result: dict[str, Any] = {"mode": "overlapped" if overlapped else "serial"}
    try:
        if overlapped:
            times: list[float] = []
            t0 = time.perf_counter()
            share = -(-out_bytes // len(paths))

            def timed_write(i: int) -> None:
                _write_file(
                    paths[i], max(0, min(share, out_bytes - i * share)), early_writeback=True
                )
                times.append(time.perf_counter() - t0)

            streams = [threading.Thread(target=timed_write, args=(i,)) for i in range(len(paths))]
            for t in streams:
                t.start()
            result["bytes_read"] = _read_ranges(ranges, threads)
            result["read_s"] = time.perf_counter() - t0
            for t in streams:
                t.join()
            result["write_s"] = max(times)
            result["writers"] = len(paths)
            result["total_s"] = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            result["bytes_read"] = _read_ranges(ranges, threads)
            result["read_s"] = time.perf_counter() - t0
            for key, early in (("write_plain_s", False), ("write_early_writeback_s", True)):
                t1 = time.perf_counter()
                _write_file(path, out_bytes, early_writeback=early)
                result[key] = time.perf_counter() - t1
                os.unlink(path)
            result["write_s"] = min(result["write_plain_s"], result["write_early_writeback_s"])
            result["total_s"] = result["read_s"] + result["write_s"]
        result["bytes_written"] = out_bytes
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    return result
