"""Ranged reads of an object store, coalesced and fetched ahead within a byte budget.

A merge reads each tensor's fragments from every rank's file in output order: tensor 0 from
ranks 0..N-1, then tensor 1 from ranks 0..N-1, and so on. Read one by one, that is one ranged
GET per fragment (about 6,700 per merge of an 80B model at world size 256), each paying the
store's time to first byte. Yet in each rank's file the fragments of consecutive tensors lie
side by side. `plan_requests` walks the reads in output order and keeps a few requests open per
file; a read joins one when it lies within `max_gap` bytes of its range (the gap is read and
discarded), up to what the request reserved of the budget when it opened. `Prefetcher` then
fetches the requests in the order they are first needed, `in_flight` at once, and lends the
reads as views of the fetched buffers (`RequestView.view_range`, which the copy pipeline uses
as it does for memory-mapped local files).

Memory: a request's whole range is fetched before its first read and held until its last, so
the plan counts, at every read, the reservations of the requests open there, and keeps them
within `budget`. The prefetcher counts every buffer from before its request is sent until the
buffer is freed (its last view dropped) and sends nothing while that count would pass `budget`:
the prefetched bytes never exceed it, and because the plan fits the same budget, the next
request needed always fits once the views already consumed are dropped (no deadlock).

Bytes are counted in the storage's `IOCounter` by the source's own `read_range` (one request per
coalesced read, gap bytes included, as they go over the wire); CRCs are taken over the bytes
each read asked for, as before, so the integrity ledgers are unchanged.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from zerosafe.io.buffers import allocate_buffer
from zerosafe.io.storage import ByteSource

__all__ = [
    "MAX_GAP_BYTES",
    "OPEN_PER_FILE",
    "WASTE_DIVISOR",
    "PlannedRead",
    "Prefetcher",
    "Request",
    "RequestView",
    "plan_requests",
]

MAX_GAP_BYTES = 1 << 20
"""Largest gap between two reads of one file that one request reads through (and discards):
at 30 ms to first byte and ~100 MB/s per connection, 1 MiB costs about a third of a request."""
WASTE_DIVISOR = 32
"""A request reads through gaps only while they total at most 1/32 of the bytes it was asked
for: a small checkpoint's Adam moments (between its fp32 records) stay in the bucket."""
OPEN_PER_FILE = 4
"""Requests one file keeps open at once: reads alternate between a rank's optimizer groups
(weights; biases and norms), which lie apart in its file."""


@dataclass(frozen=True, slots=True)
class PlannedRead:
    """One read, in consumption order: `nbytes` at `offset` of file `file`."""

    file: Hashable
    offset: int
    nbytes: int
    stream: Hashable = None
    """What the read is part of (a record: a rank's optimizer group), whose reads go forward
    together; the budget is shared between the streams."""


@dataclass(slots=True)
class Request:
    """One ranged read `[start, end)` of one file, serving the reads `first`..`last`."""

    file: Hashable
    start: int
    end: int
    first: int
    last: int
    useful: int = 0
    """Bytes the reads asked for (the rest are gaps read through)."""
    reserved: int = 0
    """The most the range may grow to (counted against the budget while it is open)."""

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_requests(
    reads: Sequence[PlannedRead],
    *,
    budget: int,
    max_request: int,
    max_gap: int = MAX_GAP_BYTES,
    open_per_file: int = OPEN_PER_FILE,
) -> tuple[list[Request], list[int]]:
    """Coalesce `reads` (in the order they are consumed) into ranged requests.

    A request's whole range is fetched before its first read and held until its last, so
    growing it later would add to the bytes held at every position since its first read. Each
    request therefore reserves, when it opens, the most it may grow to: its stream's share of
    `budget` (`PlannedRead.stream`: a ZeRO rank's file holds one record per optimizer group,
    read in turn; `budget` is split evenly, but a stream never gets more than it still has to
    read, the rest going to the others), at most `max_request` and at least its first read. The reservations of
    the open requests stay within `budget` (the oldest close to make room), which bounds the
    bytes held at any position. A read joins an open request of its file when it lies within
    `max_gap` bytes of its range (on either side), the range stays within the reservation and
    the gaps within 1/`WASTE_DIVISOR` of the bytes asked for; a file keeps up to
    `open_per_file` requests open. A read larger than `max_request` is the caller's to split.

    Returns:
        The requests, in the order their first read comes (the order to fetch them), and for
        each read the index of its request.
    """
    if budget < max_request:
        raise ValueError(f"budget {budget} is below one request of {max_request} bytes")
    left: list[int] = [0] * len(reads)  # bytes its stream still reads, from each read on
    totals: dict[tuple[Hashable, Hashable], int] = {}
    for i in range(len(reads) - 1, -1, -1):
        key = (reads[i].file, reads[i].stream)
        totals[key] = left[i] = totals.get(key, 0) + reads[i].nbytes
    share = _fair_share(list(totals.values()), budget, max_request)
    requests: list[Request] = []
    owner: list[int] = []
    open_: dict[int, None] = {}  # open request indices, oldest first
    by_file: dict[Hashable, list[int]] = {}
    held = 0  # reservations of the open requests

    def close(index: int) -> None:
        nonlocal held
        del open_[index]
        by_file[requests[index].file].remove(index)
        held -= requests[index].reserved

    for i, read in enumerate(reads):
        if read.nbytes > max_request:
            raise ValueError(f"read of {read.nbytes} bytes is over max_request {max_request}")
        end = read.offset + read.nbytes
        joined = False
        for index in by_file.get(read.file, ()):
            req = requests[index]
            if read.offset > req.end + max_gap or end < req.start - max_gap:
                continue
            lo, hi = min(req.start, read.offset), max(req.end, end)
            useful = req.useful + read.nbytes
            if hi - lo <= req.reserved and (hi - lo - useful) * WASTE_DIVISOR <= useful:
                req.start, req.end, req.last, req.useful = lo, hi, i, useful
                owner.append(index)
                joined = True
                break
        if joined:
            continue
        mine = by_file.setdefault(read.file, [])
        if len(mine) >= open_per_file:
            close(min(mine, key=lambda j: requests[j].last))
        reserve = max(read.nbytes, min(share, left[i] + left[i] // WASTE_DIVISOR))
        for index in list(open_):  # oldest first: they have had their chance to grow
            if held + reserve <= budget:
                break
            close(index)
        requests.append(Request(read.file, read.offset, end, i, i, read.nbytes, reserve))
        index = len(requests) - 1
        open_[index] = None
        mine.append(index)
        held += reserve
        owner.append(index)
    return requests, owner


def _fair_share(totals: list[int], budget: int, cap: int) -> int:
    """The largest `share` with `sum(min(share, t) for t in totals) <= budget` (water-filling),
    at most `cap`: streams that need less than an even split leave the rest to the others."""
    remaining, count = budget, len(totals)
    for t in sorted(totals):
        if t * count >= remaining:
            return max(1, min(cap, remaining // count))
        remaining -= t
        count -= 1
    return cap


class _Gate:
    """Counts bytes held; `acquire` waits until they fit under the limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._cond = threading.Condition()
        self._closed = False

    def acquire(self, n: int) -> bool:
        with self._cond:
            while not self._closed and self.held + n > self.limit:
                self._cond.wait()
            if self._closed:
                return False
            self.held += n
            self.peak = max(self.peak, self.held)
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.held -= n
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass(eq=False, slots=True)
class _Slot:
    """A request being fetched: its future buffer, dropped once every read has had its view."""

    request: Request
    source: ByteSource
    future: Future[Any] | None = field(default_factory=Future)
    unread: int = 0


class RequestView:
    """The `ByteSource` of the reads one coalesced request serves: views of its buffer."""

    prefetched = True
    """Tells the copy pipeline this source lends views and needs no read buffer of its own."""

    def __init__(self, slot: _Slot, lock: threading.Lock) -> None:
        self._slot = slot
        self._lock = lock
        self.url = slot.source.url
        self.size_bytes = slot.source.size_bytes

    def view_range(self, offset: int, nbytes: int) -> memoryview:
        slot = self._slot
        future = slot.future
        if future is None:
            raise RuntimeError(f"{self.url}: a coalesced request was read past its plan")
        buf = future.result()
        lo = offset - slot.request.start
        if lo < 0 or lo + nbytes > slot.request.nbytes:
            raise RuntimeError(f"{self.url}: read [{offset}, +{nbytes}) outside its request")
        view = memoryview(buf)[lo : lo + nbytes]
        with self._lock:
            slot.unread -= nbytes
            if slot.unread <= 0:
                slot.future = None  # the buffer lives on only in the views lent
        return view

    def readinto_at(self, offset: int, buf: memoryview) -> None:
        buf[:] = self.view_range(offset, len(buf))

    def read_range(self, start: int, end: int) -> bytes:
        return bytes(self.view_range(start, end - start))

    def close(self) -> None:
        pass


class Prefetcher:
    """Fetches planned requests in order, `in_flight` at once, holding at most `budget` bytes.

    Args:
        requests: From `plan_requests`, with the source to read each from.
        reads_per_request: Bytes each request's reads will take views of; the buffer is let go
            once they all have.
        budget: Bytes of fetched buffers held at once (the plan's budget).
        in_flight: Requests sent at once.
    """

    def __init__(
        self,
        requests: Sequence[tuple[Request, ByteSource]],
        reads_per_request: Sequence[int],
        *,
        budget: int,
        in_flight: int,
    ) -> None:
        self._lock = threading.Lock()
        self._copy_lock = threading.Lock()
        self._slots = [
            _Slot(req, src, unread=n)
            for (req, src), n in zip(requests, reads_per_request, strict=True)
        ]
        self.views = [RequestView(s, self._lock) for s in self._slots]
        self.gate = _Gate(budget)
        self._pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="zerosafe-get")
        self._in_flight = threading.Semaphore(in_flight)
        self._stop = False
        self.fetched_bytes = 0
        """Bytes fetched (the requests' whole ranges, gaps included)."""
        self.requests_sent = 0
        self._thread = threading.Thread(target=self._issue, name="zerosafe-prefetch", daemon=True)
        self._thread.start()

    @property
    def peak_bytes(self) -> int:
        """Most bytes of fetched buffers held at once."""
        return self.gate.peak

    def _issue(self) -> None:
        issued = 0
        for slot in self._slots:
            size = slot.request.nbytes
            if self._stop or not self.gate.acquire(size):
                break
            self._in_flight.acquire()
            if self._stop:
                self._in_flight.release()
                self.gate.release(size)
                break
            self._pool.submit(self._fetch, slot)
            issued += 1
        for slot in self._slots[issued:]:  # stopped early: no reader may wait for these
            future = slot.future
            if future is not None and not future.done():
                future.set_exception(RuntimeError("prefetch stopped"))

    def _fetch(self, slot: _Slot) -> None:
        size = slot.request.nbytes
        future = slot.future
        assert future is not None
        owned = True  # the budget's `size` bytes are this call's to release
        try:
            # The response arrives as `bytes`, which the cast cannot read in place (torch wants
            # a writable buffer): copy it into a buffer whose end releases the budget. One copy
            # at a time, so at most one request's bytes are held twice.
            data = slot.source.read_range(slot.request.start, slot.request.end)
            with self._copy_lock:
                buf = allocate_buffer(size)
                buf[:] = data
                del data
            weakref.finalize(buf, self.gate.release, size)
            owned = False
            with self._lock:
                self.fetched_bytes += size
                self.requests_sent += 1
            future.set_result(buf)
            del buf
        except BaseException as e:
            if owned:
                self.gate.release(size)
            if not future.done():
                future.set_exception(e)
        finally:
            self._in_flight.release()

    def close(self) -> None:
        """Stop fetching; reads still waiting fail, buffers fetched are let go."""
        self._stop = True
        self.gate.close()
        self._thread.join()
        self._pool.shutdown(wait=True)
        for slot in self._slots:
            slot.future = None
