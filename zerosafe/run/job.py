"""The steps of one job after planning, for both executors (`run_job`), and what steers a
run besides its options (`RunSettings`).

Both the in-process driver (`zerosafe.driver.convert_checkpoint`) and the flow `convert`
(`zerosafe_app.flows.convert`) plan, hold the work area, then call `run_job`: the shards a
repair keeps, the units (`zerosafe.run.schedule.Scheduler` on the executor the caller
opens), the run's statistics, the lease check, publish, the summary and the cleanup warning.
Where the steps differ (publish and cleanup as Prefect tasks, statistics from the task
journal) the executor does them (`JobExecutor`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Protocol

from zerosafe.config import ConvertOptions
from zerosafe.errors import ConfigError
from zerosafe.io.lease import Lease
from zerosafe.io.storage import Storage
from zerosafe.pipeline import WorkLayout, cleanup_warning, parts_to_extract, stage_bytes, summarize
from zerosafe.plan.model import Plan
from zerosafe.run.schedule import DiskChecks, Executor, Scheduler, StageResults
from zerosafe.run.workers import MODES
from zerosafe.stages.output import reusable_shards
from zerosafe.stages.results import JobPlan, PublishResult, RunStats, RunSummary
from zerosafe.stages.streaming import COPY_MODES

__all__ = ["JobExecutor", "RunSettings", "run_job"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """How a run's units run, besides its options: read from the environment only where a
    run starts (the `zerosafe` command, the flow `convert`: `from_environ`), then passed down.
    """

    workers: str = "threads"
    """`threads`, `processes`, or `auto` (processes for a job big enough to pay for them;
    `zerosafe.run.workers.process_options`): `ZEROSAFE_WORKERS`."""
    copy: str = "auto"
    """How local copies run: `fused`, `pipeline` or `auto` (`zerosafe.stages.streaming.
    CopyPolicy`): `ZEROSAFE_COPY`."""

    def __post_init__(self) -> None:
        for name, value, modes in (
            ("ZEROSAFE_WORKERS", self.workers, MODES),
            ("ZEROSAFE_COPY", self.copy, COPY_MODES),
        ):
            if value not in modes:
                raise ConfigError(
                    f"{name}={value!r}: expected one of {', '.join(modes)}; unset it for the "
                    "default"
                )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], *, workers: str = "threads") -> RunSettings:
        """The settings `ZEROSAFE_WORKERS` and `ZEROSAFE_COPY` in `environ` ask for; `workers`
        where the first is unset (the command's default is `auto`).

        Raises:
            ConfigError: For a value that names no mode.
        """
        return cls(
            workers=(environ.get("ZEROSAFE_WORKERS") or workers).strip().lower(),
            copy=(environ.get("ZEROSAFE_COPY") or "auto").strip().lower(),
        )


class JobExecutor(Executor, Protocol):
    """An executor that also runs a job's last steps (`run_job`)."""

    notes: tuple[str, ...]
    """What the summary says of how the units ran (worker processes)."""

    def stats(self, results: StageResults, *, seconds: float) -> RunStats: ...

    def publish(self, results: StageResults, stats: RunStats) -> PublishResult: ...

    def finish(self) -> object | None:
        """Remove the work files; the error where that failed (the output is complete)."""
        ...


OpenExecutor = Callable[[Collection[int], dict[str, int]], AbstractContextManager[JobExecutor]]
"""Opens the job's executor, given the shards a repair keeps and each stage's bytes."""


def run_job(
    job: JobPlan,
    plan: Plan,
    storage: Storage,
    options: ConvertOptions,
    *,
    open_executor: OpenExecutor,
    run_id: str,
    started: float,
    leases: Sequence[Lease] = (),
) -> RunSummary:
    """Run a planned job whose work area the caller holds: its units, then publish.

    Args:
        job: What inspect decided.
        plan: Its plan.
        storage: Where it reads and writes.
        options: The job's options.
        open_executor: Opens who runs the units (`OpenExecutor`).
        run_id: The run holding the work area (`zerosafe.pipeline.hold_work`).
        started: `time.monotonic()` when the run started.
        leases: Checked before publishing: a run that lost one publishes nothing.

    Returns:
        The run's summary.
    """
    reused = reusable_shards(storage, job.destination, plan)
    parts = parts_to_extract(job, direct=options.direct, reused=reused)
    checks = DiskChecks(plan, storage, WorkLayout(job.work_url), job.destination)
    with open_executor(reused, stage_bytes(job, parts, direct=options.direct)) as executor:
        results = Scheduler(
            job, executor, checks, parts=parts, direct=options.direct, reused=reused,
            run_id=run_id,
        ).run()  # fmt: skip
        stats = executor.stats(results, seconds=time.monotonic() - started)
        for lease in leases:  # another run took over: it owns the output now
            lease.check()
        published = executor.publish(results, stats)
        notes = executor.notes
    verifies = results.ordered()[2]
    summary = summarize(job, published, verifies, seconds=time.monotonic() - started)
    notes = ((results.resumed,) if results.resumed else ()) + notes
    summary = replace(summary, notes=(*summary.notes, *notes))
    error = executor.finish()
    if error is not None:
        warning = cleanup_warning(job.destination, job.work_url, error)
        log.warning("%s", warning)
        summary = replace(summary, warnings=(*summary.warnings, warning))
    return summary
