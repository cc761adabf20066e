"""Stage 1: read the checkpoint's metadata, plan the conversion, store the plan as Parquet."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from zerosafe.config import ConvertOptions
from zerosafe.pipeline import plan_job
from zerosafe_app.tasks._common import is_transient
from zerosafe_app.tasks.credentials import storage_for


@task(
    name="inspect",
    task_run_name="inspect",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=is_transient,
)
def inspect(
    source: str,
    destination: str,
    options: ConvertOptions,
    *,
    tag: str | None = None,
    work_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Plan the job (`zerosafe.pipeline.plan_job`); returns the `JobPlan` as JSON, whose
    `state` is `done` when the destination already holds this very conversion.

    Never cached: it is cheap (metadata only) and decides what every other task's key is.
    """
    storage = storage_for(storage_options)
    job = plan_job(storage, source, destination, options, tag=tag, work_url=work_dir)
    return job.to_json()
