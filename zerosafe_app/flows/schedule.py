"""The flow's executor: the engine's scheduler (`zerosafe.run.schedule.Scheduler`) hands
units over, and this runs each as a Prefect task (`PrefectExecutor`), so Dask and every
Prefect task runner run them and Prefect's cache keeps their results.

Cache keys are `zerosafe_app.tasks._common.cache_key` of (stage, job key, unit, the
`fingerprint` the scheduler computed); where the scheduler finds a unit's output missing or
changed on disk it asks for `refresh`, and the task runs again whatever its cache holds. A
verify's fingerprint holds the run, so a rerun verifies every shard again
(`zerosafe.pipeline.verify_fingerprint`). Statistics come from the task journal (which tasks
really ran, and each stage's memory), publish and the cleanup are tasks of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import State

from zerosafe.config import ConvertOptions
from zerosafe.errors import VerificationError
from zerosafe.io.storage import Storage
from zerosafe.pipeline import run_stats
from zerosafe.run.schedule import Policy, StageName, StageResults, Unit, UnitFuture
from zerosafe.run.workers import processes_note
from zerosafe.stages.results import JobPlan, PublishResult, RunStats
from zerosafe_app.tasks._common import read_journal, stage_memory, workers_peak_rss
from zerosafe_app.tasks.extract import extract
from zerosafe_app.tasks.merge import merge
from zerosafe_app.tasks.publish import finish, publish
from zerosafe_app.tasks.verify import verify

__all__ = ["PrefectExecutor", "Submit"]

log = logging.getLogger(__name__)


class Submit(Protocol):
    """Submits `task(*args, **kwargs)`; `refresh` runs it even if a cached result exists."""

    def __call__(
        self, task: Any, *args: Any, refresh: bool = False, **kwargs: Any
    ) -> UnitFuture: ...


class PrefectExecutor:
    """Runs units as the flow's tasks (`zerosafe.run.schedule.Executor`), and the job's last
    steps (`zerosafe.run.job.JobExecutor`).

    Args:
        job: What inspect decided.
        task_job: The JSON job context every task gets (`zerosafe_app.tasks._common.Job`).
        submit: Submits a task (with the run's result storage).
        policy: How many tasks are in flight (no `limit` on Dask: it orders them).
        options: The options units run with (in worker processes: their share).
        storage: Where the journal is read.
        on_done: Called with (stage, index) as each unit finishes (progress).
        failure_key: The artifact key of a failed publish's table.
        job_options: The job's own options (stats), where units run with a share of them.
    """

    def __init__(
        self,
        job: JobPlan,
        task_job: dict[str, Any],
        *,
        submit: Submit,
        policy: Policy,
        options: ConvertOptions,
        storage: Storage | None = None,
        on_done: Callable[[str, int], None] = lambda stage, index: None,
        failure_key: str = "",
        job_options: ConvertOptions | None = None,
    ) -> None:
        self.job, self.task_job, self._submit = job, task_job, submit
        self.policy, self.options, self.storage = policy, options, storage
        self._on_done, self._failure_key = on_done, failure_key
        self.job_options = job_options or options
        workers = task_job.get("workers", 0)
        self.notes: tuple[str, ...] = (processes_note(workers),) if workers else ()

    def kept(self, unit: Unit) -> Mapping[str, Any] | None:
        return None  # Prefect's cache is consulted in the task run (`refresh` bypasses it)

    def unit_done(self, stage: StageName, index: int, *, kept: bool) -> None:
        self._on_done(stage, index)

    def submit(self, unit: Unit) -> UnitFuture:
        count, waits = len(self.job.shards), list(unit.waits)
        if unit.stage == "extract":
            assert unit.part is not None
            return self._submit(
                extract, self.task_job, unit.index, unit.part.rank, unit.part.label,
                refresh=unit.refresh,
            )  # fmt: skip
        if unit.stage == "merge":
            return self._submit(
                merge, self.task_job, unit.index, unit.index + 1, count,
                fingerprint=unit.fingerprint, refresh=unit.refresh, wait_for=waits,
                streams=unit.streams,
            )  # fmt: skip
        return self._submit(
            verify, self.task_job, unit.index, unit.index + 1, count, unit.expected,
            fingerprint=unit.fingerprint, wait_for=waits,
        )  # fmt: skip

    def stats(self, results: StageResults, *, seconds: float) -> RunStats:
        """The run's stats, with what the journal says of this run's tasks (its entries carry
        the run id): which ran (not cached) and each stage's own memory peak."""
        assert self.storage is not None
        journal = read_journal(self.storage, self.job.work_url, run_id=self.task_job["run_id"])
        growth, baseline = stage_memory(journal)
        extracts, merges, verifies = results.ordered()
        return run_stats(
            self.job, self.job_options, extracts=extracts, merges=merges,
            verifies=verifies, seconds=seconds,
            tasks_executed={
                stage: sum(1 for e in journal if e["stage"] == stage)
                for stage in ("extract", "merge", "verify")
            },
            # the process's lifetime peak (ru_maxrss), as the command line has always
            # reported, and the job's worker processes' peaks where units ran in them
            peak_rss_bytes=max((e["peak_rss_bytes"] for e in journal), default=0)
            + workers_peak_rss(self.task_job),
            # Each stage's own peak: the most one of its tasks raised the RSS
            # (zerosafe_app/tasks/_common.py).
            rss_growth_bytes_by_stage=growth, rss_baseline_bytes=baseline,
        )  # fmt: skip

    def publish(self, results: StageResults, stats: RunStats) -> PublishResult:
        extracts, merges, verifies = results.ordered()
        try:
            published = publish(
                self.task_job, [e.to_json() for e in extracts], [m.to_json() for m in merges],
                [v.to_json() for v in verifies], stats.to_json(), wait_for=results.verify_futures,
            )  # fmt: skip
        except VerificationError as e:
            rows = "\n".join(
                f"| {f['file']} | {f['tensor']} | {f['check']} | {f['detail']} |"
                for f in e.failures[:200]
            )
            create_markdown_artifact(
                "# zerosafe: checks failed, nothing published\n\n| file | tensor | check | "
                f"detail |\n|---|---|---|---|\n{rows}\n",
                key=self._failure_key or None,
            )
            raise
        return PublishResult.from_json(published)

    def finish(self) -> object | None:
        # `stage_task` types a task's result as its JSON; with `return_state` it is its state
        cleanup = cast("State[None]", finish(self.task_job, return_state=True))
        if cleanup.is_failed():  # the output is complete: say what is left, do not fail
            return cleanup.result(raise_on_failure=False)
        return None
