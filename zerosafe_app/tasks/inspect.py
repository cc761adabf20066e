"""Stage 1: read the checkpoint's metadata, plan the conversion, store the plan as Parquet."""

from __future__ import annotations

from typing import Any

from zerosafe.config import ConvertOptions
from zerosafe.pipeline import plan_job
from zerosafe.stages.results import JobPlan
from zerosafe_app.tasks.credentials import storage_for
from zerosafe_app.tasks.edge import stage_task


@stage_task("inspect", run_name="inspect")
def inspect(
    source: str,
    destination: str,
    options: ConvertOptions,
    *,
    tag: str | None = None,
    work_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> JobPlan:
    """Plan the job (`zerosafe.pipeline.plan_job`); its `state` is `done` when the
    destination already holds this very conversion.

    Never cached: it is cheap (metadata only) and decides what every other task's key is.
    """
    storage = storage_for(storage_options)
    return plan_job(storage, source, destination, options, tag=tag, work_url=work_dir)
