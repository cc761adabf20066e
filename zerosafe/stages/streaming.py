"""The bounded-memory copy pipeline every stage uses: read ranges, cast, hash, write.

Reader threads fill fixed buffers with `readinto` (no per-chunk allocation), the calling
thread casts chunk by chunk with torch (round-to-nearest-even), and a writer thread hashes and
appends to the output. All buffers come from one pool of `PIPELINE_BUFFERS` chunks, so a task
holds at most `PIPELINE_BUFFERS * chunk_bytes` of data whatever the size of a tensor.

Local files copied while the units running at once fill half the cores or more are instead
copied block by block (`copy_mode`, `_copy_fused`): each 1 MiB block is read, CRC'd and cast
by the calling thread and hashed and written by one writer thread while it is still in cache,
which costs less CPU per byte than handing 64 MiB chunks between threads.

From an object store (every source remote), the reads are instead coalesced into fewer, larger
ranged requests fetched ahead and concurrently (`zerosafe.io.coalesce`): `PREFETCH_BUFFERS`
chunks' worth of the budget go to the fetched requests, which lend the reads as views, and
the pool keeps the other chunks for cast output and the write queue. The bound is the same.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from zerosafe.cast import TORCH_STEP, cast_into
from zerosafe.config import PIPELINE_BUFFERS, usable_cores
from zerosafe.dtypes import dtype_info
from zerosafe.errors import ConfigError
from zerosafe.formats.crc import CrcLedger
from zerosafe.formats.crc import crc32 as _crc32
from zerosafe.io.buffers import allocate_buffer, pin_mmap_threshold
from zerosafe.io.coalesce import PlannedRead, Prefetcher, plan_requests
from zerosafe.io.residency import cached_fraction
from zerosafe.io.s3 import TransferSettings
from zerosafe.io.storage import ByteSource, is_local, local_path

__all__ = [
    "CopyJob",
    "FUSED_STREAM_BYTES",
    "PrefetchLimits",
    "copy_in_streams",
    "CopyPolicy",
    "copy_mode",
    "copy_stream",
    "fusable",
    "prefetch_limits",
    "TensorWriter",
]

_READ_AHEAD = 3
_CAST_STEP = TORCH_STEP
"""A run of `_cast` is a multiple of torch's short step, so a torch cast splits it evenly."""
_WRITE_QUEUE = 2
_CAST_THREADS = max(1, min(2, os.cpu_count() or 1))
"""Threads that cast one chunk (the caller's and helpers); 2 keeps cores for readers/writer."""
_PARALLEL_CAST_MIN = 8 * _CAST_STEP
"""Elements below which a chunk is cast by the caller alone (a helper's hand-off costs more)."""
assert _READ_AHEAD + _WRITE_QUEUE + 3 <= PIPELINE_BUFFERS
PREFETCH_BUFFERS = PIPELINE_BUFFERS - (_WRITE_QUEUE + 2)
"""Chunks of the budget that coalesced object-store reads may hold; the pool keeps the rest
for cast output (one being cast, the write queue, one being written)."""
FUSED_BLOCK_BYTES = 1 << 20
"""Source bytes per step when local files are copied block by block (`_copy_fused`): with
its cast output a block stays in a core's L2 cache (2 MiB a core on the machines measured)."""
_FUSED_OUT_BUFFERS = 4
"""Cast blocks between the fused loop and its writer thread (one being filled, the queue, one
being written)."""
FUSED_STREAM_BYTES = FUSED_BLOCK_BYTES * (1 + _FUSED_OUT_BUFFERS)
"""What one fused copy holds: its read block and its cast blocks."""
_PREFETCH_AHEAD = 64 * 2**20
"""Source bytes the fused loop asks the kernel to read ahead of it (page cache, not the
task's memory), in requests of `_PREFETCH_STEP`."""
_PREFETCH_STEP = 8 * 2**20
_WARM_FRACTION = 0.9
"""Of the pages a copy reads, the fraction the page cache must hold for it to run fused."""
COPY_MODES = ("auto", "fused", "pipeline")


@dataclass(frozen=True, slots=True)
class CopyPolicy:
    """How local-to-local copies run, as the run that starts them decides: a field of the
    run's settings passed down with each unit (`zerosafe.run.settings.RunSettings`), never a
    setting of the process."""

    mode: str = "auto"
    """`fused`, `pipeline`, or `auto` (the `ZEROSAFE_COPY` environment variable of the
    command or flow that started the run)."""
    tasks_at_once: int = 1
    """Units running at once on this machine (the run's parallel tasks, a worker pool's
    size): `auto` copies fused once they fill half the cores."""

    def __post_init__(self) -> None:
        if self.mode not in COPY_MODES:
            raise ConfigError(
                f"ZEROSAFE_COPY={self.mode!r}: expected one of {', '.join(COPY_MODES)}; unset "
                "it for the default"
            )

    def fused(self) -> bool:
        """Whether copies run fused (`copy_mode`)."""
        return copy_mode(self) == "fused"


def copy_mode(policy: CopyPolicy) -> str:
    """How local-to-local copies run: `policy.mode` where it names one (`fused`,
    `pipeline`), else fused when the units running at once (`policy.tasks_at_once`) fill at
    least half the usable cores, the threaded pipeline otherwise.

    Measured on the 16-core machine (bench/scaling.py, 2B into tmpfs, worker processes, GB/s
    of fp32): fused 1.73 / 9.20 / 10.82 at 1 / 8 / 16 tasks, the pipeline 2.11 / 9.68 / 9.91.
    One fused unit keeps about 1.7 cores busy and the pipeline 2.4, for about 15% more CPU per
    byte: the pipeline is faster while cores are spare, fused once they are not.
    """
    if policy.mode != "auto":
        return policy.mode
    return "fused" if 2 * max(1, policy.tasks_at_once) >= usable_cores() else "pipeline"


COALESCE_READS = True
"""Coalesce and prefetch reads when every source is remote (off: one ranged read per chunk of
each fragment, as before; the benchmark's baseline)."""


class TensorWriter(Protocol):
    """Where copied bytes go: a `SafetensorsStreamWriter`, or one of its `TensorRangeWriter`s."""

    sink: Any
    """The file's sink (its `url` says whether the copy may run fused)."""

    def write(self, index: int, data: memoryview | bytes) -> None: ...


@dataclass(frozen=True, slots=True)
class CopyJob:
    """Copy `nbytes` of `source` at `offset` into tensor `tensor` of the writer, casting."""

    tensor: int
    source: ByteSource
    offset: int
    nbytes: int
    src_dtype: str
    out_dtype: str
    crc_key: str | None = None
    """Ledger key of the record these bytes belong to (None: do not track)."""
    crc_offset: int = 0
    """Offset of `offset` relative to the record's first byte."""


class _BufferPool:
    """At most `count` buffers of `size` bytes, allocated on first need and then reused."""

    def __init__(self, count: int, size: int) -> None:
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._size = size
        self._unallocated = count
        self._lock = threading.Lock()

    def acquire(self) -> bytearray:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._unallocated > 0:
                self._unallocated -= 1
                return allocate_buffer(self._size)  # type: ignore[return-value]
        return self._free.get()

    def release(self, buf: bytearray) -> None:
        self._free.put(buf)


def _chunks(jobs: Iterable[CopyJob], chunk_bytes: int) -> Iterator[tuple[CopyJob, int, int]]:
    for job in jobs:
        src_size = dtype_info(job.src_dtype).itemsize
        out_size = dtype_info(job.out_dtype).itemsize
        elems = max(1, chunk_bytes // max(src_size, out_size))
        step = elems * src_size
        pos = 0
        while pos < job.nbytes:
            n = min(step, job.nbytes - pos)
            yield job, pos, n
            pos += n


def _chunk_need(job: CopyJob, chunk_bytes: int) -> int:
    """Largest buffer one chunk of `job` needs (its source or its cast output)."""
    src_size = dtype_info(job.src_dtype).itemsize
    out_size = dtype_info(job.out_dtype).itemsize
    elems = min(job.nbytes // src_size, max(1, chunk_bytes // max(src_size, out_size)))
    return elems * max(src_size, out_size)


def _coalescable(source: ByteSource) -> bool:
    """A remote source read by ranged requests (not a local file, not already lending views)."""
    return not is_local(source.url) and not hasattr(source, "view_range")


@dataclass(frozen=True, slots=True)
class PrefetchLimits:
    """How coalesced reads are sized for one copy (see `prefetch_limits`)."""

    max_request: int
    budget: int
    in_flight: int


def prefetch_limits(chunk_bytes: int, settings: TransferSettings | None = None) -> PrefetchLimits:
    """Of the `PREFETCH_BUFFERS * chunk_bytes` given to fetched requests, one request's worth is
    kept for the copy out of each response and the rest is the plan's budget; a request is at
    most the storage's `range_size` (and a quarter of the share), and `2 * max_requests` are in
    flight (the two readers of the uncoalesced path each had `max_requests`)."""
    settings = settings or TransferSettings()
    share = PREFETCH_BUFFERS * chunk_bytes
    max_request = max(4096, min(settings.range_bytes, share // 4))
    return PrefetchLimits(max_request, share - max_request, 2 * settings.max_requests)


def _prefetch_jobs(
    jobs: list[CopyJob], chunk_bytes: int
) -> tuple[list[CopyJob], Prefetcher] | None:
    """`jobs` rewritten to read from coalesced requests fetched ahead (`prefetch_limits`), and
    their fetcher; None unless every job reads a remote source."""
    if not COALESCE_READS or not jobs or not all(_coalescable(j.source) for j in jobs):
        return None
    settings = getattr(jobs[0].source, "transfer", None)
    limits = prefetch_limits(
        chunk_bytes, settings if isinstance(settings, TransferSettings) else None
    )
    max_request, budget, in_flight = limits.max_request, limits.budget, limits.in_flight
    pieces: list[tuple[CopyJob, int, int]] = []  # (job, position in it, bytes)
    reads: list[PlannedRead] = []
    sources: dict[str, ByteSource] = {}
    for job in jobs:
        itemsize = dtype_info(job.src_dtype).itemsize
        step = max(itemsize, max_request - max_request % itemsize)
        sources.setdefault(job.source.url, job.source)
        for pos in range(0, job.nbytes, step):
            n = min(step, job.nbytes - pos)
            pieces.append((job, pos, n))
            reads.append(PlannedRead(job.source.url, job.offset + pos, n, job.crc_key))
    requests, owner = plan_requests(reads, budget=budget, max_request=max_request)
    wanted = [0] * len(requests)
    for index, read in zip(owner, reads, strict=True):
        wanted[index] += read.nbytes
    prefetcher = Prefetcher(
        [(r, sources[str(r.file)]) for r in requests], wanted, budget=budget, in_flight=in_flight
    )
    out = [
        CopyJob(
            job.tensor,
            prefetcher.views[index],
            job.offset + pos,
            n,
            job.src_dtype,
            job.out_dtype,
            job.crc_key,
            job.crc_offset + pos,
        )  # fmt: skip
        for (job, pos, n), index in zip(pieces, owner, strict=True)
    ]
    return out, prefetcher


def _read(job: CopyJob, pos: int, n: int, buf: bytearray | None) -> tuple[int | None, memoryview]:
    """Read a chunk (into `buf`, or as a view of a `zerosafe.io.mapped.MappedSource` or of a
    prefetched request) and CRC it."""
    view_range = getattr(job.source, "view_range", None)
    if view_range is not None:  # a mapped source lends its pages: no copy into `buf`
        view = view_range(job.offset + pos, n)
    else:
        assert buf is not None
        view = memoryview(buf)[:n]
        job.source.readinto_at(job.offset + pos, view)
    return (_crc32(view) if job.crc_key is not None else None), view


def _cast(
    src: memoryview,
    src_dtype: str,
    out: bytearray,
    out_dtype: str,
    helpers: ThreadPoolExecutor | None = None,
) -> memoryview:
    """Cast (round-to-nearest-even: `zerosafe.cast`, numpy for bfloat16 and float32 output,
    torch otherwise) in the calling thread and `helpers`.

    A large chunk is cut in equal runs, one per helper thread plus the caller's (numpy and torch
    release the GIL while they copy): the cast was the one stage of a merge that ran on one core.
    """
    src_size, out_size = dtype_info(src_dtype).itemsize, dtype_info(out_dtype).itemsize
    count = len(src) // src_size
    out_view = memoryview(out)
    if count == 0:
        return out_view[:0]
    ways = 1 if helpers is None or count < _PARALLEL_CAST_MIN else _CAST_THREADS
    per = -(-count // ways)
    per += -per % _CAST_STEP
    runs = []
    for i in range(0, count, per):
        n = min(per, count - i)
        runs.append(
            (src[i * src_size : (i + n) * src_size], src_dtype,
             out_view[i * out_size : (i + n) * out_size], out_dtype, n)
        )  # fmt: skip
    waits = [helpers.submit(cast_into, *run) for run in runs[1:]] if helpers else []
    cast_into(*runs[0])
    for pending_cast in waits:
        pending_cast.result()
    return out_view[: count * out_size]


class _Writer(threading.Thread):
    """Hashes and writes queued chunks, each into the `TensorWriter` queued with it (one
    copy's, or every stream's of a merge: `copy_in_streams`); after an error it keeps
    draining so no one blocks."""

    def __init__(self, pool: _BufferPool, queue_size: int = _WRITE_QUEUE) -> None:
        super().__init__(name="zerosafe-writer", daemon=True)
        self.pool = pool
        self.queue: queue.Queue[tuple[TensorWriter, int, memoryview, bytearray | None] | None] = (
            queue.Queue(queue_size)
        )
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            writer, index, view, buf = item
            del item  # a prefetched request's buffer goes with its last view: drop it here
            try:
                if self.error is None:
                    writer.write(index, view)
            except BaseException as e:  # re-raised by the producer
                self.error = e
            finally:
                del view
                if buf is not None:
                    self.pool.release(buf)


def _plan_reads(
    jobs: list[CopyJob], chunk_bytes: int
) -> tuple[list[CopyJob], Prefetcher | None, _BufferPool]:
    """The jobs as `copy_stream` reads them (from coalesced requests fetched ahead, where
    `prefetch_limits` allows), the prefetcher if so, and the chunk buffer pool: with a
    prefetcher, reads are views of fetched requests and the pool only holds casts."""
    biggest = max((_chunk_need(j, chunk_bytes) for j in jobs), default=0)
    prefetch = _prefetch_jobs(jobs, chunk_bytes)
    prefetcher = None
    buffers = PIPELINE_BUFFERS
    if prefetch is not None:
        jobs, prefetcher = prefetch
        buffers -= PREFETCH_BUFFERS
    return jobs, prefetcher, _BufferPool(buffers, min(chunk_bytes, biggest))


def _in_out_dtype(
    job: CopyJob,
    data: memoryview,
    buf: bytearray | None,
    pool: _BufferPool,
    casters: ThreadPoolExecutor,
) -> tuple[bytearray | None, memoryview]:
    """A chunk read as (buffer to release once written, bytes to write): `data` as read when
    the dtypes agree, else cast into a buffer of the pool (the read's buffer goes back)."""
    if job.src_dtype == job.out_dtype:
        return buf, data
    out_buf = pool.acquire()
    view = _cast(
        data, job.src_dtype, out_buf, job.out_dtype, casters if _CAST_THREADS > 1 else None
    )
    if buf is not None:
        pool.release(buf)
    return out_buf, view


def fusable(jobs: Iterable[CopyJob], writer: TensorWriter) -> bool:
    """Whether `jobs` may be copied block by block (`_copy_fused`): every source and the
    output are local files, and the page cache holds the sources' ranges (at least
    `_WARM_FRACTION` of their pages, `cachestat`; a kernel that cannot tell counts as warm).

    From a cold disk the pipeline is faster: its reader threads map 64 MiB chunks while the
    caller casts. At 7B (28 GB of masters, more than the 24 GB of RAM) on the 2-core machine
    a whole command took 29.4 s with the pipeline, 39.7 s fused (35.9 s of system time for
    `pread` into a reclaimed page cache), 33.7 s fused with the kernel asked to read ahead,
    and 33.4 s fused through memory maps."""
    spans = _local_spans(jobs, writer)
    if spans is None:
        return False
    cached = cached_fraction((path, lo, hi - lo) for path, (lo, hi) in spans.items())
    return cached is None or cached >= _WARM_FRACTION


def _local_spans(jobs: Iterable[CopyJob], writer: TensorWriter) -> dict[str, list[int]] | None:
    """Per source file, the span `[first, end)` of `jobs`' bytes; None unless every source
    and the output are local files."""
    if not is_local(str(getattr(writer.sink, "url", ""))):
        return None  # an object store's sink sends its parts from `write`: keep it off-thread
    spans: dict[str, list[int]] = {}
    for job in jobs:
        if not is_local(job.source.url):
            return None
        span = spans.setdefault(local_path(job.source.url), [job.offset, job.offset])
        span[0] = min(span[0], job.offset)
        span[1] = max(span[1], job.offset + job.nbytes)
    return spans


def _fused(
    jobs: list[CopyJob], writer: TensorWriter, fused: bool | None, copy: CopyPolicy | None
) -> bool:
    """Whether `copy_stream` copies `jobs` block by block: `fused` where given (for local
    files: a caller that decided with `fusable`, whose answer a second look at the page
    cache could change), else `copy` (`CopyPolicy`), for a copy `fusable` allows."""
    if not jobs:
        return False
    if fused is not None:
        return fused and _local_spans(jobs, writer) is not None
    return (copy or CopyPolicy()).fused() and fusable(jobs, writer)


def _copy_fused(
    jobs: list[CopyJob],
    writer: TensorWriter,
    ledger: CrcLedger | None,
    on_bytes: Callable[[int], None] | None,
    shared: _Writer | None = None,
) -> int:
    """Read (`pread`, not a memory map), CRC and cast each block of `FUSED_BLOCK_BYTES` in
    the calling thread, and hash and write it in a writer thread: a block stays in cache from
    its read to its write, where the pipeline's chunks of up to 64 MiB cross memory once per
    step (a 1B merge on 2 cores: 2.0 CPU-seconds in one thread against the pipeline's 3.0-3.5).
    A record's CRC runs on across its blocks and goes to the ledger once per contiguous run
    (combining 1 MiB pieces in `CrcLedger.add` took 5% of the time). A block that keeps its
    dtype (float32 output, the default) is read straight into the writer's buffer: copying it
    there cost 1.5-8% of a 1B merge+verify on one core (3 interleaved pairs).

    `shared`: a writer thread (and its buffers) that other copies use too, which its owner
    starts and stops (`copy_in_streams`); by default the copy has its own.
    """
    block = FUSED_BLOCK_BYTES
    buf = allocate_buffer(block)
    write_thread = shared or _Writer(_BufferPool(_FUSED_OUT_BUFFERS, block))
    pool = write_thread.pool
    if shared is None:
        write_thread.start()
    run: list[Any] = [None, 0, 0, 0]  # the CRC being run on: key, offset, length, crc
    # The kernel reads ahead what the loop will read next (`prefetch`), so that a cold source
    # is fetched while blocks are cast: the pipeline's reader threads did that.
    ahead = _chunks(jobs, _PREFETCH_STEP)
    advised = consumed = 0
    total = sum(j.nbytes for j in jobs)

    def flush_crc() -> None:
        if run[0] is not None and ledger is not None:
            ledger.add(run[0], run[1], run[2], run[3])
        run[0] = None

    try:
        for job, pos, n in _chunks(jobs, block):
            while advised < consumed + _PREFETCH_AHEAD:
                item = next(ahead, None)
                if item is None:
                    advised = total
                    break
                source, at, size = item[0].source, item[0].offset + item[1], item[2]
                prefetch = getattr(source, "prefetch", None)
                if prefetch is not None:
                    prefetch(at, size)
                advised += size
            consumed += n
            same = job.src_dtype == job.out_dtype
            out = pool.acquire() if same else None  # read straight into the writer's block
            data = memoryview(out if out is not None else buf)[:n]
            job.source.readinto_at(job.offset + pos, data)
            if job.crc_key is not None and ledger is not None:
                at = job.crc_offset + pos
                if run[0] == job.crc_key and run[1] + run[2] == at:
                    run[2] += n
                    run[3] = _crc32(data, run[3])
                else:
                    flush_crc()
                    run[:] = [job.crc_key, at, n, _crc32(data)]
            if out is None:
                out = pool.acquire()
                view = _cast(data, job.src_dtype, out, job.out_dtype)
            else:
                view = data
            del data
            if write_thread.error is not None:
                pool.release(out)
                raise write_thread.error
            write_thread.queue.put((writer, job.tensor, view, out))
            del view, out
            if on_bytes is not None:
                on_bytes(n)
        flush_crc()
    finally:
        if shared is None:
            write_thread.queue.put(None)
            write_thread.join()
    if write_thread.error is not None:
        raise write_thread.error
    return total


def copy_in_streams(
    groups: list[list[CopyJob]],
    writers: list[TensorWriter],
    ledgers: list[CrcLedger],
    on_bytes: Callable[[int], None] | None,
) -> int:
    """Copy each group of jobs (local files) into its writer, block by block (`_copy_fused`),
    one thread per group, with every block written by one writer thread.

    The writers are ranges of one file (a merge's streams), and threads writing one file
    queue on its lock, spinning: two threads `pwrite`-ing 1 GB into the two halves of one
    file took as long as one thread (0.21-0.24 s against 0.20 on ext4, 0.35 against 0.33 on
    tmpfs) and 1.6-1.9x its CPU. One writer thread writes what the streams read, check and
    cast in parallel. (On 2 cores a 0.5B shard in 2 streams took as long either way, 0.83-0.84
    s into tmpfs; with more streams on more cores it is not measured.)

    Returns:
        Bytes read.
    """
    shared = _Writer(
        _BufferPool(_FUSED_OUT_BUFFERS * len(groups), FUSED_BLOCK_BYTES),
        queue_size=_WRITE_QUEUE * len(groups),
    )
    shared.start()
    try:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="zerosafe-stream") as pool:
            futures = [
                pool.submit(_copy_fused, jobs, writer, ledger, on_bytes, shared)
                for jobs, writer, ledger in zip(groups, writers, ledgers, strict=True)
                if jobs  # a run of empty tensors: nothing to read
            ]
            wait(futures)  # every stream stops before the writer does
    finally:
        shared.queue.put(None)
        shared.join()
    read = sum(f.result() for f in futures)  # a stream's own error first
    if shared.error is not None:
        raise shared.error
    return read


def copy_stream(
    jobs: Iterable[CopyJob],
    writer: TensorWriter,
    *,
    chunk_bytes: int,
    ledger: CrcLedger | None = None,
    on_bytes: Callable[[int], None] | None = None,
    num_readers: int = 2,
    fused: bool | None = None,
    copy: CopyPolicy | None = None,
) -> int:
    """Run `jobs` in order into `writer` (which must be positioned at their first tensor).

    Args:
        jobs: Ranges to copy, in output order.
        writer: The open output file; it is not finished here.
        chunk_bytes: Size of each pipeline buffer.
        ledger: Receives the CRC32 of every range read whose job names a `crc_key`.
        on_bytes: Called with the source bytes of each chunk once it is queued for writing.
        num_readers: Threads reading at once.
        fused: Copy local files block by block (True), through the pipeline (False), or as
            `copy` says (None).
        copy: How the run's copies run (`CopyPolicy`); by default one unit at a time, auto.

    Returns:
        Bytes read from the sources: the jobs' bytes, or with coalesced reads the requests'
        whole ranges (gaps read through included), as they went over the wire.
    """
    jobs = list(jobs)
    if _fused(jobs, writer, fused, copy):
        return _copy_fused(jobs, writer, ledger, on_bytes)
    pin_mmap_threshold()
    jobs, prefetcher, pool = _plan_reads(jobs, chunk_bytes)
    write_thread = _Writer(pool)
    write_thread.start()
    chunks = _chunks(jobs, chunk_bytes)
    pending: deque[
        tuple[CopyJob, int, int, bytearray | None, Future[tuple[int | None, memoryview]]]
    ]
    pending = deque()
    try:
        with (
            ThreadPoolExecutor(
                max_workers=num_readers, thread_name_prefix="zerosafe-read"
            ) as readers,
            ThreadPoolExecutor(
                max_workers=max(1, _CAST_THREADS - 1), thread_name_prefix="zerosafe-cast"
            ) as casters,
        ):

            def submit_next() -> None:
                item = next(chunks, None)
                if item is None:
                    return
                job, pos, n = item
                buf = None if prefetcher is not None else pool.acquire()
                pending.append((job, pos, n, buf, readers.submit(_read, job, pos, n, buf)))

            try:
                for _ in range(_READ_AHEAD):
                    submit_next()
                while pending:
                    job, pos, n, buf, future = pending.popleft()
                    try:
                        crc, data = future.result()
                    except BaseException:
                        if buf is not None:
                            pool.release(buf)
                        raise
                    del future
                    submit_next()
                    if crc is not None and ledger is not None and job.crc_key is not None:
                        ledger.add(job.crc_key, job.crc_offset + pos, n, crc)
                    out_buf, view = _in_out_dtype(job, data, buf, pool, casters)
                    # A mapped chunk is unmapped once its last view goes; a prefetched
                    # request's buffer is freed, and leaves the budget, with its last view.
                    del data
                    if write_thread.error is not None:
                        if out_buf is not None:
                            pool.release(out_buf)
                        raise write_thread.error
                    write_thread.queue.put((writer, job.tensor, view, out_buf))
                    del view, out_buf, buf
                    if on_bytes is not None:
                        on_bytes(n)
            finally:
                for _, _, _, _, pending_read in pending:  # stop reads nobody will consume
                    pending_read.cancel()
                if prefetcher is not None:  # readers waiting on a request fail, not hang
                    prefetcher.close()
    finally:
        write_thread.queue.put(None)
        write_thread.join()
    if write_thread.error is not None:
        raise write_thread.error
    if prefetcher is not None:
        return prefetcher.fetched_bytes
    return sum(j.nbytes for j in jobs)
