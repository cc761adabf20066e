"""Stage 5: check the CRC ledgers, then write the index, the manifest and, last, the marker;
then, as a task of its own, remove the work files.

Each task is safe to retry: a publish whose marker this job already wrote returns what it
returned the first time (`zerosafe.pipeline.publish_job`), and cleanup removes what is still
there. They are two tasks so a transient error while removing the work files retries only
the removal, never the publish (which would then find its intermediates gone).
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from zerosafe.pipeline import finish_job, publish_job
from zerosafe.stages.results import ExtractResult, MergeResult, RunStats, VerifyResult
from zerosafe_app.tasks._common import context, is_transient, job_of, record_run
from zerosafe_app.tasks.credentials import storage_for


@task(
    name="publish",
    task_run_name="publish",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=is_transient,
)
def publish(
    job: dict[str, Any],
    extracts: list[dict[str, Any]],
    merges: list[dict[str, Any]],
    verifies: list[dict[str, Any]],
    stats: dict[str, Any],
) -> dict[str, Any]:
    """Publish a verified output (`zerosafe.pipeline.publish_job`); returns the
    `PublishResult` as JSON. Raises (and writes no marker, and discards the run's work) if
    any check failed."""
    j = job_of(job)
    plan, storage, options, work = context(j)
    published = publish_job(
        plan, storage, j.destination, work, options,
        extracts=[ExtractResult.from_json(e) for e in extracts],
        merges=[MergeResult.from_json(m) for m in merges],
        verifies=[VerifyResult.from_json(v) for v in verifies],
        stats=RunStats.from_json(stats),
    )  # fmt: skip
    record_run(j, "publish", 0, {})
    return published.to_json()


@task(
    name="finish",
    task_run_name="finish",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=is_transient,
)
def finish(job: dict[str, Any]) -> None:
    """After a publish: remove the pending folder and the work area, unless `keep_work`
    (`zerosafe.pipeline.finish_job`)."""
    j = job_of(job)
    finish_job(
        storage_for(j.storage_options), destination=j.destination, job_key=j.job_key,
        work_url=j.work, keep_work=j.options.keep_work,
    )  # fmt: skip
