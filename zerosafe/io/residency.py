"""Whether parallel merges would fight over one disk: its kind and what the page cache holds.

Two merges that read a checkpoint in place read each rank file at two places at once. On a
device that reports itself rotational (a disk, or a virtual disk that says it is one), with
the checkpoint not in the page cache, that gains nothing over one merge at a time with the
previous shard's verify beside it. On the development machine's virtual disk at 7B (ZeRO-3,
world size 8, cold, runs interleaved), the flow converted in 91.6 and 97.6 s one merge at a
time against 97.7 and 98.4 s with two, at 0.69 GB of peak memory against 0.81 GB, and its
verifies re-read each shard from the page cache (with two merges, 3.8 GB of the shards had
been evicted and were read from the disk again). Where the checkpoint is cached, or the device
is solid-state or remote (NFS), parallel merges are faster (docs/performance.md, "Scaling with
cores"), so they stay the default there.

Residency is counted with the `cachestat` system call (Linux 6.5 and later), which reads
nothing and starts no readahead; where it is missing, merges keep running in parallel. The device's
kind is `/sys/dev/block/MAJOR:MINOR/queue/rotational` (a partition's is its disk's).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["cached_fraction", "rotational_device", "serial_merge_reason"]

_CACHED_ENOUGH = 0.9
"""A checkpoint with at least this fraction of its pages cached counts as warm."""


def rotational_device(path: str) -> str | None:
    """The block device holding `path` when it reports itself rotational, else None (solid
    state, a network or virtual file system, or not Linux)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    real = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for disk in (real, os.path.dirname(real)):  # a partition's queue is its disk's
        try:
            with open(os.path.join(disk, "queue", "rotational")) as f:
                rotational = f.read().strip() == "1"
        except OSError:
            continue
        return os.path.basename(disk) if rotational else None
    return None


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")
    ]


_SYS_CACHESTAT = 451  # the same number on every architecture's unified syscall table
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc if sys.platform == "linux" else None
    except OSError:
        return None


def cached_fraction(ranges: Iterable[tuple[str, int, int]]) -> float | None:
    """The fraction of the pages of `(path, offset, nbytes)` ranges that the page cache
    holds, or None where the kernel cannot tell (`cachestat`, Linux 6.5 and later).

    `cachestat` only counts: unlike a read with `RWF_NOWAIT`, it starts no readahead.
    """
    ranges = [r for r in ranges if r[2] > 0]
    libc = _libc()
    if not ranges or libc is None:
        return None
    cached = pages = 0
    fds: dict[str, int] = {}
    try:
        for path, offset, nbytes in ranges:
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
            first, end = offset // _PAGE * _PAGE, offset + nbytes
            span, stat = _Range(first, end - first), _Stat()
            if libc.syscall(_SYS_CACHESTAT, fds[path], ctypes.byref(span), ctypes.byref(stat), 0):
                return None  # ENOSYS (an older kernel) or a file system that cannot say
            cached += stat.cache
            pages += -(-(end - first) // _PAGE)
    except OSError:
        return None
    finally:
        for fd in fds.values():
            os.close(fd)
    return min(1.0, cached / pages) if pages else None


def serial_merge_reason(ranges: Sequence[tuple[str, int, int]]) -> str:
    """Why merges that read `ranges` (local `(path, offset, nbytes)`) in place should run one
    at a time, or "" when they may run in parallel."""
    if not ranges:
        return ""
    device = rotational_device(ranges[0][0])
    if device is None:
        return ""
    cached = cached_fraction(ranges)
    if cached is None or cached >= _CACHED_ENOUGH:
        return ""
    return (
        f"merges run one at a time (each verify beside the next merge): the checkpoint is on "
        f"'{device}', a device that reports itself rotational, and {cached:.0%} of it is in the "
        "page cache, so parallel merges would interleave their reads on the disk"
    )
