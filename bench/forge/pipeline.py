"""Chunk pipeline: worker threads fill and CRC chunks (numpy and zlib release the GIL), the caller
writes them in order; a fixed pool of buffers bounds memory.
"""

from __future__ import annotations

import threading
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from zerosafe.formats.crc import crc32_zeros

from .pickles import STORAGE_ITEMSIZE, Piece, Storage
from .values import BLOCK, fill_16bit, fill_fp32
from .zipwriter import ZipWriter


class Pipeline:
    def __init__(self, chunk_bytes: int, threads: int, seed: int) -> None:
        self.chunk_bytes = max(1 << 16, chunk_bytes - chunk_bytes % 64)
        self.threads = max(1, threads)
        self.seed = seed
        self.nbuf = self.threads + 2
        self.free: list[np.ndarray] = []
        self.allocated = 0
        self.zero: np.ndarray | None = None
        self.local = threading.local()
        self.ex = (
            ThreadPoolExecutor(self.threads, thread_name_prefix="forge")
            if self.threads > 1
            else None
        )

    def close(self) -> None:
        if self.ex is not None:
            self.ex.shutdown()

    def _buffer(self) -> np.ndarray:
        if self.free:
            return self.free.pop()
        self.allocated += 1
        return np.empty(self.chunk_bytes, np.uint8)

    def _scratch(self) -> tuple[np.ndarray, np.ndarray]:
        s = getattr(self.local, "s", None)
        if s is None:
            s = self.local.s = (np.empty(BLOCK, np.uint32), np.empty(BLOCK, np.uint32))
        return s

    def _fill(
        self, task: list[Piece], buf: np.ndarray, cls: str
    ) -> tuple[np.ndarray, memoryview, int]:
        itemsize = STORAGE_ITEMSIZE[cls]
        if len(task) == 1 and task[0][0] == "zeros":
            n = task[0][3] * itemsize
            assert self.zero is not None
            return buf, memoryview(self.zero)[:n], crc32_zeros(n)
        pos = 0
        for kind, name, start, count in task:
            region = buf[pos * itemsize : (pos + count) * itemsize]
            if kind == "zeros":
                region.fill(0)
            elif cls == "FloatStorage":
                fill_fp32(region.view(np.uint32), name, self.seed, start)  # type: ignore[arg-type]
            else:
                scratch, tmp = self._scratch()
                dt = "bf16" if cls == "BFloat16Storage" else "fp16"
                fill_16bit(region.view(np.uint16), name, self.seed, start, dt, scratch, tmp)  # type: ignore[arg-type]
            pos += count
        mv = memoryview(buf)[: pos * itemsize]
        return buf, mv, zlib.crc32(mv)

    def _tasks(self, st: Storage) -> Iterator[list[Piece]]:
        per_chunk = self.chunk_bytes // st.itemsize
        task: list[Piece] = []
        room = per_chunk
        for kind, name, start, count in st.pieces:
            off = 0
            while off < count:
                k = min(room, count - off)
                task.append((kind, name, start + off, k))
                off += k
                room -= k
                if room == 0:
                    yield task
                    task, room = [], per_chunk
        if task:
            yield task

    def write_storage(self, zw: ZipWriter, name: str, st: Storage) -> None:
        zw.begin(name, st.nbytes)
        if st.hole:
            if st.nbytes:
                zw.hole(st.nbytes)
        elif st.raw is not None:
            if st.raw:
                zw.data(st.raw)
        else:
            if self.zero is None:
                self.zero = np.zeros(self.chunk_bytes, np.uint8)
            inflight: deque[Future[Any] | tuple[np.ndarray, memoryview, int]] = deque()

            def drain() -> None:
                item = inflight.popleft()
                buf, mv, crc = item.result() if isinstance(item, Future) else item
                zw.data(mv, crc)
                self.free.append(buf)

            for task in self._tasks(st):
                if len(inflight) >= self.nbuf:
                    drain()
                buf = self._buffer()
                if self.ex is None:
                    inflight.append(self._fill(task, buf, st.cls))
                else:
                    inflight.append(self.ex.submit(self._fill, task, buf, st.cls))
            while inflight:
                drain()
        zw.end()
