"""Coalesced object-store reads (`zerosafe.io.coalesce`): the plan's bounds, the prefetcher's
budget, and a conversion through a remote (fsspec `memory://`) source, equal to the local one."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerosafe.io.coalesce import (
    MAX_GAP_BYTES,
    WASTE_DIVISOR,
    PlannedRead,
    Prefetcher,
    plan_requests,
)


def _held_at_each_read(requests: list, n: int) -> list[int]:
    """Bytes of the requests whose reads span each position: what must be held there."""
    held = [0] * n
    for r in requests:
        for i in range(r.first, r.last + 1):
            held[i] += r.nbytes
    return held


def test_interleaved_ranks_coalesce_into_one_request_per_rank() -> None:
    # 50 tensors, 64 ranks: tensor t's fragment on rank r at r's offset 4000*t (output order
    # tensor-major, file order tensor-major within each rank), with 100-byte gaps (padding).
    reads = [PlannedRead(r, 4100 * t, 4000) for t in range(50) for r in range(64)]
    requests, owner = plan_requests(reads, budget=64 << 20, max_request=8 << 20)
    assert len(requests) == 64
    assert all(r.nbytes == 4100 * 49 + 4000 for r in requests)
    assert [owner[r] for r in range(64)] == list(range(64))


def test_budget_and_max_request_split_the_requests() -> None:
    reads = [PlannedRead(r, 4096 * t, 4096) for t in range(256) for r in range(16)]
    requests, _ = plan_requests(reads, budget=16 * 64 * 1024, max_request=128 * 1024)
    # 1 MiB of data per rank and 64 KiB of budget per rank: requests close oldest first, so
    # their sizes stagger between 0 and 128 KiB (max_request) and average more than 64 KiB.
    assert 16 * 8 <= len(requests) <= 16 * 16
    assert max(_held_at_each_read(requests, len(reads))) <= 16 * 64 * 1024
    requests, _ = plan_requests(reads, budget=64 << 20, max_request=128 * 1024)
    assert len(requests) == 16 * 8  # max_request binds: 1 MiB per rank in 128 KiB requests


def test_far_gaps_and_big_waste_are_not_read_through() -> None:
    far = [PlannedRead("f", 0, 1000), PlannedRead("f", 1000 + MAX_GAP_BYTES + 1, 1000)]
    assert len(plan_requests(far, budget=64 << 20, max_request=8 << 20)[0]) == 2
    # a 2 KiB gap between two 1 KiB reads is more waste than 1/32 of what they ask for
    wasteful = [PlannedRead("f", 0, 1024), PlannedRead("f", 3072, 1024)]
    assert len(plan_requests(wasteful, budget=64 << 20, max_request=8 << 20)[0]) == 2
    cheap = [PlannedRead("f", 0, 1 << 20), PlannedRead("f", (1 << 20) + 4096, 1 << 20)]
    assert len(plan_requests(cheap, budget=64 << 20, max_request=8 << 20)[0]) == 1


def test_two_regions_of_one_file_read_in_turn_stay_two_requests() -> None:
    # weights at 0.., biases at 10 MB..: consumed weight, bias, weight, bias...
    reads = []
    for t in range(100):
        reads.append(PlannedRead("f", 40_000 * t, 40_000))
        reads.append(PlannedRead("f", 10_000_000 + 400 * t, 400))
    requests, _ = plan_requests(reads, budget=64 << 20, max_request=8 << 20)
    assert len(requests) == 2


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 40), st.integers(1, 8)),
        min_size=1,
        max_size=120,
    ),  # fmt: skip
    st.integers(8, 64),
    st.integers(8, 16),
)
def test_plan_bounds_hold_for_any_reads(
    spec: list[tuple[int, int, int]], budget_units: int, request_units: int
) -> None:
    unit = 1024
    reads = [PlannedRead(f, o * unit, n * unit) for f, o, n in spec]
    budget, max_request = budget_units * unit, request_units * unit
    if budget < max_request:
        budget = max_request
    requests, owner = plan_requests(reads, budget=budget, max_request=max_request)
    assert len(owner) == len(reads)
    for i, (read, index) in enumerate(zip(reads, owner, strict=True)):
        r = requests[index]
        assert r.file == read.file and r.start <= read.offset
        assert read.offset + read.nbytes <= r.end and r.first <= i <= r.last
    assert all(r.nbytes <= max_request for r in requests)
    assert all((r.nbytes - r.useful) * WASTE_DIVISOR <= r.useful for r in requests)
    assert [r.first for r in requests] == sorted(r.first for r in requests)
    assert max(_held_at_each_read(requests, len(reads))) <= budget


class _SlowSource:
    """A remote-looking source whose reads each wait `delay` seconds; counts reads."""

    def __init__(self, data: bytes, delay: float = 0.002) -> None:
        self.url = "s3://bucket/file"
        self.size_bytes = len(data)
        self.data = data
        self.delay = delay
        self.reads = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.fail_at: int | None = None
        self._lock = threading.Lock()

    def read_range(self, start: int, end: int) -> bytes:
        with self._lock:
            self.reads += 1
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            failing = self.fail_at is not None and self.reads >= self.fail_at
        time.sleep(self.delay)
        with self._lock:
            self.in_flight -= 1
        if failing:
            raise ConnectionResetError("connection reset by peer")
        return self.data[start:end]

    def readinto_at(self, offset: int, buf: memoryview) -> None:
        buf[:] = self.read_range(offset, offset + len(buf))

    def close(self) -> None:
        pass


def test_prefetcher_lends_the_right_bytes_within_budget() -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    src = _SlowSource(data)
    reads = [PlannedRead("f", 8192 * t + 1024 * r, 1024) for t in range(128) for r in range(8)]
    budget = 64 * 1024
    requests, owner = plan_requests(reads, budget=budget, max_request=16 * 1024)
    wanted = [0] * len(requests)
    for index, read in zip(owner, reads, strict=True):
        wanted[index] += read.nbytes
    pre = Prefetcher([(r, src) for r in requests], wanted, budget=budget, in_flight=4)
    try:
        for read, index in zip(reads, owner, strict=True):
            view = pre.views[index].view_range(read.offset, read.nbytes)
            assert view == data[read.offset : read.offset + read.nbytes]
            del view
    finally:
        pre.close()
    assert src.reads == len(requests) < len(reads) / 8
    assert pre.fetched_bytes == sum(r.nbytes for r in requests)
    assert pre.peak_bytes <= budget
    assert src.peak_in_flight <= 4
    assert pre.gate.held == 0  # every buffer freed and given back


def test_prefetch_error_reaches_the_reader_and_close_never_hangs() -> None:
    data = bytes(1 << 20)
    src = _SlowSource(data)
    src.fail_at = 3
    reads = [PlannedRead("f", 16384 * i, 16384) for i in range(64)]
    requests, owner = plan_requests(reads, budget=64 * 1024, max_request=16 * 1024)
    pre = Prefetcher(
        [(r, src) for r in requests], [16384] * len(requests), budget=64 * 1024, in_flight=2
    )
    with pytest.raises(ConnectionResetError):
        for read, index in zip(reads, owner, strict=True):
            pre.views[index].view_range(read.offset, read.nbytes)
    started = time.monotonic()
    pre.close()
    assert time.monotonic() - started < 5


class MergeTrace:
    """Wraps `zerosafe.pipeline.merge_shard`: per merge, its fragments and the reads (requests)
    and bytes the storage counted while it ran (nothing else runs during a merge here)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import zerosafe.pipeline as pipeline
        from zerosafe.stages import streaming

        self.merges: list[dict[str, int]] = []
        self.gates: list[Any] = []
        original = pipeline.merge_shard
        trace = self

        def traced(*args: Any, **kwargs: Any) -> Any:
            plan, shard, storage = args[0], args[1], args[2]
            counter = storage.counter
            before = counter.read_requests, counter.bytes_read
            result = original(*args, **kwargs)
            trace.merges.append(
                {
                    "fragments": sum(
                        len(plan.fragments.for_tensor(t.index)) for t in plan.shard_tensors(shard)
                    ),
                    "requests": counter.read_requests - before[0],
                    "bytes": counter.bytes_read - before[1],
                    "files": len(plan.parts),
                    "streams": len(plan.slots),  # one piece per slot, in one part each
                }
            )
            return result

        class Recording(Prefetcher):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                trace.gates.append(self.gate)

        monkeypatch.setattr(pipeline, "merge_shard", traced)
        monkeypatch.setattr(streaming, "Prefetcher", Recording)


def merge_request_bound(merge: dict[str, int], options: Any) -> int:
    """Requests a merge may make with coalescing: two header reads per intermediate, and its
    bytes in requests of the budget shared by the streams (a rank's optimizer groups and
    buffers, each one record), plus one partial request per stream."""
    from zerosafe.stages.streaming import prefetch_limits

    limits = prefetch_limits(options.chunk_bytes)
    per_stream = min(limits.max_request, limits.budget // merge["streams"])
    return 2 * merge["files"] + -(-merge["bytes"] // per_stream) + merge["streams"]


def test_conversion_from_a_remote_source_is_coalesced_and_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ZeRO-3 checkpoint at world size 16 read through fsspec (`memory://`, remote to the
    engine): a merge makes requests in proportion to its bytes, far fewer than its fragments,
    within the prefetch budget, and the output equals the local conversion."""
    import fsspec

    from bench.forge import forge_checkpoint, transformer_shapes
    from zerosafe.config import ConvertOptions
    from zerosafe.driver import convert_checkpoint
    from zerosafe.io.storage import Storage
    from zerosafe.stages import streaming

    ckpt = tmp_path / "ckpt"
    forge_checkpoint(
        ckpt, shapes=transformer_shapes(2_000_000), stage=3, world_size=16, dtype="bf16"
    )
    local = tmp_path / "local"
    convert_checkpoint(str(ckpt), str(local), ConvertOptions())
    fs = fsspec.filesystem("memory")
    root = f"/zs-{tmp_path.name}"
    for path in ckpt.rglob("*"):
        if path.is_file():
            fs.pipe(f"{root}/ckpt/{path.relative_to(ckpt).as_posix()}", path.read_bytes())
    options = ConvertOptions(memory=48 * 2**20)  # the smallest budget: 2 MiB chunks
    trace = MergeTrace(monkeypatch)
    try:
        for coalesce in (False, True):
            monkeypatch.setattr(streaming, "COALESCE_READS", coalesce)
            out = f"memory://{root}/out-{coalesce}"
            convert_checkpoint(f"memory://{root}/ckpt", out, options, storage=Storage())
            for f in local.glob("model*.safetensors"):
                assert fs.cat_file(f"{root}/out-{coalesce}/{f.name}") == f.read_bytes()
    finally:
        fs.rm(root, recursive=True)
    before, after = trace.merges
    assert before["requests"] >= before["fragments"]
    assert after["requests"] <= merge_request_bound(after, options)
    assert after["requests"] * 4 < after["fragments"]
    # Fetched bytes stayed within the budget, and every buffer was freed by the end.
    assert trace.gates and all(0 < g.peak <= g.limit for g in trace.gates)
    assert all(g.held == 0 for g in trace.gates)
