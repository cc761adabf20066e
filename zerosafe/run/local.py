"""The executor of the command's own process: units in threads here, or in worker processes
(`zerosafe.run.workers.UnitPool`), with `UnitRecords` in the work area as their cache, so a
killed run started again resumes (`LocalExecutor`).

Its policy (`local_policy`) is what the in-process driver has always done:

- **one or two tasks**, or merges that must run one at a time (a rotational disk,
  `JobPlan.serial_merges`): one extract or merge at a time, sharing one set of open source
  files, with (at two tasks) a shard's verify beside the next merge: it re-reads what the
  merge just wrote, mostly from the page cache and on the other core, while the next merge
  waits on the disk. (A merge that ends while the last verify still runs has its own verify
  start next, before the next merge, as under any limit: verify first.);
- **more tasks**: N units at once, a merged shard verified next, each merge opening its own
  readers; in worker processes (where asked: `zerosafe.run.workers.process_options`) the
  same, each thread here waiting on a worker: N tasks on N cores, none queued on this
  interpreter. Either way the budget is divided among the N tasks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from zerosafe.cast import output_needs_torch
from zerosafe.config import ConvertOptions
from zerosafe.errors import StorageError
from zerosafe.io.storage import Storage
from zerosafe.pipeline import (
    WorkLayout,
    extract_unit,
    finish_job,
    merge_unit,
    open_locator,
    peak_rss_bytes,
    publish_job,
    run_stats,
    unit_key_options,
    unit_process_options,
    verify_unit,
)
from zerosafe.plan.model import Plan
from zerosafe.run.job import RunSettings
from zerosafe.run.progress import Progress
from zerosafe.run.schedule import DiskChecks, Policy, StageName, StageResults, Unit
from zerosafe.run.unit_records import UnitRecords, unit_key
from zerosafe.run.workers import Shared, UnitPool, processes_note
from zerosafe.stages.results import JobPlan, PublishResult, RunStats
from zerosafe.stages.shards import DirectLocator, StagedLocator
from zerosafe.stages.streaming import CopyPolicy

__all__ = ["LocalExecutor", "local_policy", "open_local"]

_T = TypeVar("_T")


def local_policy(
    job: JobPlan, options: ConvertOptions, *, workers: int = 0, to_merge: int
) -> tuple[Policy, int]:
    """The command's policy (see the module docstring) and the units its copies may count
    on running at once (`CopyPolicy.tasks_at_once`).

    Args:
        workers: Worker processes the units run in; 0 for threads of this process.
        to_merge: Shards this run merges (for the copies: no more run at once than there are).
    """
    at_once = workers or options.parallel_tasks
    whole_units = workers > 0 or (at_once > 2 and not job.serial_merges)
    if whole_units:
        policy = Policy(limit=at_once, at_once=at_once)
    else:
        policy = Policy(limit=min(at_once, 2), at_once=at_once, one_copy=True)
    if workers:  # each worker process copies as one of `workers` on the machine
        return policy, workers
    return policy, min(max(1, to_merge), at_once if whole_units else 1)


@contextlib.contextmanager
def open_local(
    job: JobPlan,
    plan: Plan,
    storage: Storage,
    options: ConvertOptions,
    *,
    settings: RunSettings,
    progress: Progress,
    reused: Collection[int],
    stages: dict[str, int],
) -> Iterator[LocalExecutor]:
    """The command's executor for one run (`zerosafe.run.job.OpenExecutor`): worker
    processes where `settings.workers` asks and the run pays for them, else threads; the
    workers stopped when the block ends."""
    unit_options = unit_process_options(job, storage, options, mode=settings.workers, reused=reused)
    progress.start("convert", sum(stages.values()), stages=stages)
    pool = None
    if unit_options is not None:
        pool = UnitPool(
            unit_options.parallel_tasks, shared={"plan": plan},
            torch=output_needs_torch(unit_options.dtype),
        )  # fmt: skip
        try:
            pool.start()
        except BaseException:
            pool.close()
            raise
    policy, copies = local_policy(
        job, options, workers=pool.workers if pool else 0, to_merge=len(plan.shards) - len(reused)
    )
    try:
        executor = LocalExecutor(
            job, plan, storage, WorkLayout(job.work_url), unit_options or options,
            policy=policy, copy=CopyPolicy(settings.copy, copies), progress=progress, pool=pool,
            job_options=options,
        )  # fmt: skip
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    try:
        yield executor
    finally:
        executor.close()
    progress.finish()


class LocalExecutor:
    """Runs units in `policy.limit` threads here, each calling its unit here or in `pool`.

    Args:
        plan: The job's plan.
        storage: Where units read and write.
        work: The work area.
        destination: The output folder.
        options: The options units run with (in workers: the budget less their overhead).
        policy: How many run at once (`local_policy`).
        copy: How the units' copies run (`zerosafe.stages.streaming.CopyPolicy`).
        progress: Receives the bytes units handle (and those of kept units).
        pool: Worker processes to run units in (closed with the executor); None for this
            process.
        job_options: The job's options, for its statistics and publish (by default
            `options`).
    """

    def __init__(
        self,
        job: JobPlan,
        plan: Plan,
        storage: Storage,
        work: WorkLayout,
        options: ConvertOptions,
        *,
        policy: Policy,
        copy: CopyPolicy,
        progress: Progress,
        pool: UnitPool | None = None,
        job_options: ConvertOptions | None = None,
    ) -> None:
        self.job, self.plan, self.storage, self.work = job, plan, storage, work
        self.options, self.policy, self.copy, self.progress = options, policy, copy, progress
        self.pool = pool
        self.job_options = job_options or options
        self.notes: tuple[str, ...] = (processes_note(pool.workers),) if pool else ()
        self.worker_rss_bytes = 0
        self.records = UnitRecords(storage, work.root)
        self.checks = DiskChecks(plan, storage, work, job.destination)
        self._key_options = unit_key_options(options)
        self._threads = ThreadPoolExecutor(policy.limit or 1, thread_name_prefix="zerosafe-unit")
        # one extract or merge at a time here: they share one set of open source files
        self._locator: DirectLocator | StagedLocator | None = None
        if policy.one_copy and pool is None:
            self._locator = open_locator(plan, storage, work, options)
        self._bytes: dict[str, dict[int, int]] = {
            "extract": {p.index: p.size_bytes for p in job.parts},
            "merge": {s.index: s.source_bytes for s in job.shards},
            "verify": {s.index: s.data_bytes for s in job.shards},
        }

    def close(self) -> None:
        """Wait for the units still running (after a failure too), then close what is open."""
        self._threads.shutdown(wait=True, cancel_futures=True)
        if self._locator is not None:
            self._locator.close()
        if self.pool is not None:
            self.worker_rss_bytes = self.pool.peak_rss_bytes
            self.pool.close()

    def stats(self, results: StageResults, *, seconds: float) -> RunStats:
        extracts, merges, verifies = results.ordered()
        workers = self.pool.peak_rss_bytes if self.pool else self.worker_rss_bytes
        return run_stats(
            self.job, self.job_options, extracts=extracts, merges=merges, verifies=verifies,
            seconds=seconds, tasks_executed=dict(results.executed),
            peak_rss_bytes=peak_rss_bytes() + workers,
        )  # fmt: skip

    def publish(self, results: StageResults, stats: RunStats) -> PublishResult:
        extracts, merges, verifies = results.ordered()
        return publish_job(
            self.plan, self.storage, self.job.destination, self.work, self.job_options,
            extracts=extracts, merges=merges, verifies=verifies, stats=stats,
        )  # fmt: skip

    def finish(self) -> object | None:
        try:
            finish_job(
                self.storage, destination=self.job.destination, job_key=self.job.job_key,
                work_url=self.job.work_url, keep_work=self.job_options.keep_work,
            )  # fmt: skip
        except (StorageError, OSError) as e:
            return e
        return None

    def _key(self, unit: Unit) -> str:
        return unit_key(
            unit.stage, self.job.job_key, unit.index, unit.fingerprint, **self._key_options
        )

    def kept(self, unit: Unit) -> Mapping[str, Any] | None:
        return self.records.load(unit.stage, unit.index, self._key(unit))

    def unit_done(self, stage: StageName, index: int, *, kept: bool) -> None:
        if kept:  # the bytes of a unit that ran were reported as it ran
            self.progress.advance(self._bytes[stage][index], stage)

    def submit(self, unit: Unit) -> Future[Any]:
        return self._threads.submit(self._run, unit)

    def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """`fn(plan, *args, **kwargs)` here, or in a worker process when there is a pool."""
        if self.pool is None:
            return fn(self.plan, *args, **kwargs)
        kwargs.pop("locator", None)  # a worker opens its own
        result: _T = self.pool.run(fn, Shared("plan"), *args, **kwargs)
        return result

    def _run(self, unit: Unit) -> Any:
        stage, index = unit.stage, unit.index

        def on_bytes(n: int) -> None:
            self.progress.advance(n, stage)

        if stage == "extract":
            result: Any = self._call(
                extract_unit, index, self.storage, self.work, self.options,
                on_bytes=on_bytes, copy=self.copy,
            )  # fmt: skip
            self.records.save(stage, index, self._key(unit), result.to_json())
        elif stage == "merge":
            result = self._call(
                merge_unit, index, self.storage, self.job.destination, self.work, self.options,
                locator=self._locator, on_bytes=on_bytes, streams=unit.streams, copy=self.copy,
            )  # fmt: skip
            if not result.reused:
                identity = list(self.checks.shard_identity(index) or ())
                self.records.save(
                    stage, index, self._key(unit), result.to_json(), identity=identity
                )
        else:
            assert unit.expected is not None
            result = self._call(
                verify_unit, index, self.storage, self.job.destination, self.options,
                expected=unit.expected, on_bytes=on_bytes,
            )  # fmt: skip
            self.records.save(stage, index, self._key(unit), result.to_json())
        return result
