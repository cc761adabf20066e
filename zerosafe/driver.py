"""The in-process driver: one conversion job in the command's own process, one unit of work
at a time (`convert_checkpoint`).

It runs the lifecycle of `zerosafe.pipeline` in order, with the same leases, cleanup and
summary as the flow `convert` in `zerosafe_app`, and records each finished unit in the work
area (`zerosafe.run.unit_records`), so a killed run started again resumes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from zerosafe.cast import output_needs_torch
from zerosafe.config import ConvertOptions
from zerosafe.errors import StorageError
from zerosafe.io.lease import Lease
from zerosafe.io.storage import Storage, normalize_url
from zerosafe.pipeline import (
    MergeReadiness,
    WorkLayout,
    cleanup_warning,
    extract_unit,
    finish_job,
    hold_destination,
    hold_work,
    intermediate_is_present,
    merge_fingerprint,
    merge_streams,
    merge_unit,
    open_locator,
    parts_to_extract,
    peak_rss_bytes,
    plan_job_and_load,
    publish_job,
    run_stats,
    shard_identity,
    stage_bytes,
    summarize,
    unit_key_options,
    unit_process_options,
    verify_fingerprint,
    verify_unit,
)
from zerosafe.plan.model import Plan
from zerosafe.run.progress import NullProgress, Progress
from zerosafe.run.unit_records import UnitRecords, unit_key
from zerosafe.run.workers import Shared, UnitPool, prestart, processes_note, worker_mode
from zerosafe.stages.output import reusable_shards
from zerosafe.stages.results import (
    ExtractResult,
    JobPlan,
    MergeResult,
    PartWork,
    RunSummary,
    VerifyResult,
)
from zerosafe.stages.shards import DirectLocator, StagedLocator
from zerosafe.stages.streaming import set_tasks_at_once

__all__ = ["convert_checkpoint"]

log = logging.getLogger(__name__)


def convert_checkpoint(
    ckpt_url: str,
    out_url: str,
    options: ConvertOptions | None = None,
    *,
    tag: str | None = None,
    storage: Storage | None = None,
    work_url: str | None = None,
    progress: Progress | None = None,
    workers: str | None = None,
) -> RunSummary:
    """Convert a checkpoint tag into verified safetensors in `out_url`, in this process.

    The same steps as the flow `convert`, one unit of work at a time: the same leases, the
    same cleanup and the same summary.

    Args:
        ckpt_url: The checkpoint folder (holding `latest`) or a tag folder.
        out_url: The output folder.
        options: Output dtype, shard size, memory budget, tied/frozen policy, direct mode.
        tag: The tag to convert instead of the one `latest` names.
        storage: Storage to read and write through (its counter records the bytes).
        work_url: Where to keep the plan and intermediates; by default inside `out_url`.
        progress: Receives byte progress.
        workers: How units run: `threads`, `processes`, or `auto` (processes for a job big
            enough to pay for them; the `zerosafe` command passes `auto` unless
            `ZEROSAFE_WORKERS` says otherwise); None reads `ZEROSAFE_WORKERS`, else
            `threads`. Processes need the caller's script to start under an
            `if __name__ == "__main__":` guard (the forkserver imports it).

    Returns:
        The run's summary (`RunSummary.to_json()` for JSON).

    Raises:
        ConversionError: For bad input or options, an output that may not be replaced, a
            live run holding the output or work area, or a failed check.
    """
    options = options or ConvertOptions()
    storage = storage or Storage()
    mode = worker_mode(workers)
    # the workers' interpreter and imports, overlapped with planning
    prestart(mode, torch=output_needs_torch(options.dtype))
    ckpt_url, out_url = normalize_url(ckpt_url), normalize_url(out_url)
    work_url = normalize_url(work_url) if work_url else None
    started = time.monotonic()
    with hold_destination(storage, ckpt_url, out_url) as out_lease:
        job, plan = plan_job_and_load(
            storage, ckpt_url, out_url, options, tag=tag, work_url=work_url
        )
        if plan is None:
            return RunSummary.already_complete(out_url, job.job_key)
        for warning in job.warnings:
            log.warning("%s", warning)
        with hold_work(storage, job) as work_lease:
            return _run_held(
                job, plan, storage, options, progress or NullProgress(), started=started,
                leases=(out_lease, work_lease), workers=mode, run_id=work_lease.run_id,
            )  # fmt: skip


def _run_held(
    job: JobPlan,
    plan: Plan,
    storage: Storage,
    options: ConvertOptions,
    progress: Progress,
    *,
    started: float,
    leases: Sequence[Lease] = (),
    workers: str = "threads",
    run_id: str,
) -> RunSummary:
    work = WorkLayout(job.work_url)
    units = _UnitRunner(job, plan, storage, work, options, progress, workers=workers, run_id=run_id)
    extracts, merges, verifies = units.run()
    stats = run_stats(
        job, options, extracts=extracts, merges=merges, verifies=verifies,
        seconds=time.monotonic() - started, tasks_executed=units.executed,
        peak_rss_bytes=peak_rss_bytes() + units.worker_rss_bytes,
    )  # fmt: skip
    for lease in leases:  # another run took over: it owns the output now
        lease.check()
    published = publish_job(
        plan, storage, job.destination, work, options,
        extracts=extracts, merges=merges, verifies=verifies, stats=stats,
    )  # fmt: skip
    summary = summarize(job, published, verifies, seconds=time.monotonic() - started)
    if units.resumed:
        summary = replace(summary, notes=(*summary.notes, units.resumed))
    if units.pool is not None:
        summary = replace(summary, notes=(*summary.notes, processes_note(units.pool.workers)))
    try:
        finish_job(
            storage, destination=job.destination, job_key=job.job_key, work_url=job.work_url,
            keep_work=options.keep_work,
        )  # fmt: skip
    except (StorageError, OSError) as e:
        warning = cleanup_warning(job.destination, job.work_url, e)
        log.warning("%s", warning)
        summary = replace(summary, warnings=(*summary.warnings, warning))
    return summary


_T = TypeVar("_T")


class _UnitRunner:
    """Every unit of work of one run, in an order the flow could take: a shard is merged as
    soon as its parts are extracted, and verified as soon as it is merged.

    A unit whose record (`UnitRecords`) a killed run left, under this run's key and with its
    output still on disk as recorded, is not run again: its recorded result is used. A verify
    never is: its key holds the run (`verify_fingerprint`), so each run re-reads every shard
    it publishes.

    With two tasks (`parallel_tasks`), or where merges must run one at a time (a rotational
    disk, `JobPlan.serial_merges`), a shard's verify runs in a second thread while the next
    merge runs, as the flow's two parallel tasks would: it re-reads what the merge just wrote,
    mostly from the page cache and on the other core, while the next merge waits on the disk.
    At most one verify runs beside that merge.

    With more tasks, `parallel_tasks` threads each merge then verify one shard at a time, as
    the flow's N parallel tasks would, each merge opening its own readers; in worker processes
    (`zerosafe.run.workers.process_options`, where asked) the same, each thread here
    waiting on a worker: N tasks on N cores, none queued on this interpreter. Either way the
    budget is divided among the N tasks.
    """

    def __init__(
        self,
        job: JobPlan,
        plan: Plan,
        storage: Storage,
        work: WorkLayout,
        options: ConvertOptions,
        progress: Progress,
        *,
        workers: str = "threads",
        run_id: str,
    ) -> None:
        self.job, self.plan, self.storage, self.work = job, plan, storage, work
        self.workers, self.run_id = workers, run_id
        self.options, self.progress = options, progress
        self.records = UnitRecords(storage, work.root)
        self.key_options = unit_key_options(options)
        self.executed = {"extract": 0, "merge": 0, "verify": 0}
        self.kept = {"extract": 0, "merge": 0, "verify": 0}
        self.extracts: dict[int, ExtractResult] = {}
        self.merges: dict[int, MergeResult] = {}
        self.verifies: dict[int, VerifyResult] = {}
        self.reused: set[int] = set()
        self.pool: UnitPool | None = None
        self.unit_options = options
        """The options units run with (in workers: the budget less the workers' overhead)."""
        self.worker_rss_bytes = 0
        self._lock = threading.Lock()  # units finish in several threads with a pool
        self._merges_started = 0
        self._to_merge = self._at_once = 1

    def _count(self, counts: dict[str, int], stage: str) -> None:
        with self._lock:
            counts[stage] += 1

    def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """`fn(plan, *args, **kwargs)` here, or in a worker process when there is a pool."""
        if self.pool is None:
            return fn(self.plan, *args, **kwargs)
        kwargs.pop("locator", None)  # a worker opens its own
        result: _T = self.pool.run(fn, Shared("plan"), *args, **kwargs)
        return result

    def _start_pool(self) -> UnitPool | None:
        options = unit_process_options(
            self.job, self.storage, self.options, mode=self.workers, reused=self.reused
        )
        if options is None:
            return None
        self.unit_options = options
        self.pool = UnitPool(
            options.parallel_tasks, shared={"plan": self.plan},
            torch=output_needs_torch(options.dtype),
        )  # fmt: skip
        try:
            self.pool.start()
        except BaseException:
            self.pool.close()
            self.pool = None
            raise
        return self.pool

    def _merge_then_verify(self, shard: int) -> VerifyResult:
        self.merges[shard] = self._merge(shard, None)
        return self._verify(shard)

    @property
    def resumed(self) -> str:
        """A note naming the units a killed run had finished (empty when none)."""
        kept = [f"{n} {stage}" for stage, n in self.kept.items() if n]
        if not kept:
            return ""
        return (
            f"resumed: {', '.join(kept)} unit(s) finished by an interrupted run were kept "
            "(their output checked on disk), not run again"
        )

    def run(self) -> tuple[list[ExtractResult], list[MergeResult], list[VerifyResult]]:
        job, options = self.job, self.options
        self.reused = reusable_shards(self.storage, job.destination, self.plan)
        parts = parts_to_extract(job, direct=options.direct, reused=self.reused)
        readiness = MergeReadiness(job.shards, direct=options.direct, reused=self.reused)
        stages = stage_bytes(job, parts, direct=options.direct)
        self.progress.start("convert", sum(stages.values()), stages=stages)
        pool = self._start_pool()
        try:
            locator = open_locator(self.plan, self.storage, self.work, options)
        except BaseException:
            if pool is not None:
                pool.close()
            raise
        # N shards at once, each merged then verified by one thread: in the worker processes,
        # or as threads here where more than two tasks fit and the source may be read in
        # parallel; otherwise one merge at a time here with its verify beside the next merge.
        at_once = pool.workers if pool else options.parallel_tasks
        whole_units = pool is not None or (at_once > 2 and not self.job.serial_merges)
        to_merge = max(1, len(self.plan.shards) - len(self.reused))
        set_tasks_at_once(min(to_merge, at_once if whole_units else 1))  # copies at once
        self._to_merge, self._at_once = to_merge, at_once  # for `merge_streams`
        beside = (
            ThreadPoolExecutor(at_once if whole_units else 1, thread_name_prefix="zerosafe-unit")
            if options.parallel_tasks > 1
            else None
        )
        running: list[tuple[int, Future[VerifyResult]]] = []

        def collect() -> None:
            while running:
                shard, future = running.pop()
                self.verifies[shard] = future.result()

        def merge_and_verify(shards: list[int]) -> None:
            for shard in shards:
                if whole_units and beside is not None:
                    running.append((shard, beside.submit(self._merge_then_verify, shard)))
                    continue
                self.merges[shard] = self._merge(shard, locator)
                collect()
                if beside is None:
                    self.verifies[shard] = self._verify(shard)
                else:
                    running.append((shard, beside.submit(self._verify, shard)))

        try:
            merge_and_verify(readiness.ready())
            for part in parts:
                self.extracts[part.index] = self._extract(part)
                merge_and_verify(readiness.part_done(part.index))
            collect()
        finally:
            locator.close()
            if beside is not None:
                beside.shutdown(wait=True, cancel_futures=True)
            if pool is not None:
                self.worker_rss_bytes = pool.peak_rss_bytes
                pool.close()
        self.progress.finish()
        assert not readiness.waiting, f"shards never became ready: {readiness.waiting}"
        return (
            [self.extracts[i] for i in sorted(self.extracts)],
            [self.merges[i] for i in sorted(self.merges)],
            [self.verifies[i] for i in sorted(self.verifies)],
        )

    def _key(self, stage: str, index: int, content: str) -> str:
        return unit_key(stage, self.job.job_key, index, content, **self.key_options)

    def _extract(self, part: PartWork) -> ExtractResult:
        key = self._key("extract", part.index, "")
        record = self.records.load("extract", part.index, key)
        if record is not None:
            kept = ExtractResult.from_json(record["result"])
            if intermediate_is_present(
                self.plan, self.storage, self.work, part.index, kept.content_sha256
            ):
                self._count(self.kept, "extract")
                self.progress.advance(part.size_bytes, "extract")
                return kept
        result = self._call(
            extract_unit, part.index, self.storage, self.work, self.unit_options,
            on_bytes=lambda n: self.progress.advance(n, "extract"),
        )  # fmt: skip
        self._count(self.executed, "extract")
        self.records.save("extract", part.index, key, result.to_json())
        return result

    def _merge(self, shard: int, locator: DirectLocator | StagedLocator | None) -> MergeResult:
        work = self.job.shards[shard]
        content = merge_fingerprint(
            work, direct=self.options.direct, reused=self.reused,
            content_sha256={i: e.content_sha256 for i, e in self.extracts.items()},
        )  # fmt: skip
        key = self._key("merge", shard, content)
        record = self.records.load("merge", shard, key)
        if record is not None and record.get("identity") == list(self._identity(shard) or ()):
            with self._lock:  # one merge fewer to run: the last round is nearer
                self._to_merge = max(1, self._to_merge - 1)
            self._count(self.kept, "merge")
            self.progress.advance(work.source_bytes, "merge")
            return MergeResult.from_json(record["result"])
        streams = 1  # a shard a repair keeps reads nothing: it takes no place in the run
        if shard not in self.reused:
            with self._lock:
                position, self._merges_started = self._merges_started, self._merges_started + 1
                total = self._to_merge
            streams = merge_streams(position, total, self._at_once, self.unit_options)
        result = self._call(
            merge_unit, shard, self.storage, self.job.destination, self.work, self.unit_options,
            locator=locator, on_bytes=lambda n: self.progress.advance(n, "merge"),
            streams=streams,
        )  # fmt: skip
        if result.reused:
            return result
        self._count(self.executed, "merge")
        self.records.save(
            "merge", shard, key, result.to_json(), identity=list(self._identity(shard) or ())
        )
        return result

    def _verify(self, shard: int) -> VerifyResult:
        merged = self.merges[shard]
        content = verify_fingerprint(self._identity(shard), merged.tensors, run_id=self.run_id)
        key = self._key("verify", shard, content)
        record = self.records.load("verify", shard, key)
        if record is not None:
            self._count(self.kept, "verify")
            self.progress.advance(self.job.shards[shard].data_bytes, "verify")
            return VerifyResult.from_json(record["result"])
        result = self._call(
            verify_unit, shard, self.storage, self.job.destination, self.unit_options,
            expected=merged.tensors, on_bytes=lambda n: self.progress.advance(n, "verify"),
        )  # fmt: skip
        self._count(self.executed, "verify")
        self.records.save("verify", shard, key, result.to_json())
        return result

    def _identity(self, shard: int) -> tuple[int, str] | None:
        return shard_identity(self.plan, self.storage, self.job.destination, shard)
