"""Stage 5: check the CRC ledgers, then write the index, the manifest and, last, the marker."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from zerosafe.pipeline import finish_job, publish_job
from zerosafe.stages.results import ExtractResult, MergeResult, RunStats, VerifyResult
from zerosafe_app.tasks._common import context, is_transient, job_of, record_run


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
    """Publish a verified output (`zerosafe.pipeline.publish_job`), then remove the work
    files; returns the `PublishResult` as JSON. Raises (and writes no marker, and discards
    the run's work) if any check failed."""
    j = job_of(job)
    plan, storage, options, work = context(j)
    published = publish_job(
        plan, storage, j.destination, work, options,
        extracts=[ExtractResult.from_json(e) for e in extracts],
        merges=[MergeResult.from_json(m) for m in merges],
        verifies=[VerifyResult.from_json(v) for v in verifies],
        stats=RunStats.from_json(stats),
    )  # fmt: skip
    record_run(j, "publish", 0, {})  # before the work area (and its journal) is removed
    finish_job(
        storage, destination=j.destination, job_key=j.job_key, work_url=j.work,
        keep_work=options.keep_work,
    )  # fmt: skip
    return published.to_json()
