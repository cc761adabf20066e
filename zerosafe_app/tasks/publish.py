"""Stage 5: check the CRC ledgers, then write the index, the manifest and, last, the marker;
then, as a task of its own, remove the work files.

Each task is safe to retry: a publish whose marker this job already wrote returns what it
returned the first time (`zerosafe.pipeline.publish_job`), and cleanup removes what is still
there. They are two tasks so a transient error while removing the work files retries only
the removal, never the publish (which would then find its intermediates gone).
"""

from __future__ import annotations

from zerosafe.pipeline import finish_job, publish_job
from zerosafe.stages.results import (
    ExtractResult,
    MergeResult,
    PublishResult,
    RunStats,
    VerifyResult,
)
from zerosafe_app.tasks._common import Job, context, record_run
from zerosafe_app.tasks.credentials import storage_for
from zerosafe_app.tasks.edge import stage_task


@stage_task("publish", run_name="publish")
def publish(
    job: Job,
    extracts: list[ExtractResult],
    merges: list[MergeResult],
    verifies: list[VerifyResult],
    stats: RunStats,
) -> PublishResult:
    """Publish a verified output (`zerosafe.pipeline.publish_job`). Raises (and writes no
    marker, and discards the run's work) if any check failed."""
    plan, storage, options, work = context(job)
    published = publish_job(
        plan, storage, job.destination, work, options,
        extracts=extracts, merges=merges, verifies=verifies, stats=stats,
    )  # fmt: skip
    record_run(job, "publish", 0)
    return published


@stage_task("finish", run_name="finish")
def finish(job: Job) -> None:
    """After a publish: remove the pending folder and the work area, unless `keep_work`
    (`zerosafe.pipeline.finish_job`)."""
    finish_job(
        storage_for(job.storage_options), destination=job.destination, job_key=job.job_key,
        work_url=job.work, keep_work=job.options.keep_work,
    )  # fmt: skip
