"""Stage 2 (staged mode): copy one part of one rank's fp32 partition to an intermediate file."""

from __future__ import annotations

from typing import Any

from prefect import task

from zerosafe.pipeline import extract_unit, intermediate_is_present
from zerosafe_app.tasks._common import (
    TaskMeter,
    cache_key,
    context,
    is_transient,
    job_of,
    progress,
    record_run,
)


@task(
    name="extract",
    task_run_name="extract rank {rank} part {label}",
    cache_key_fn=cache_key("extract"),
    persist_result=True,
    retries=3,
    retry_delay_seconds=[2, 10, 30],
    retry_condition_fn=is_transient,
)
def extract(
    job: dict[str, Any], index: int, rank: int, label: str, fingerprint: str = ""
) -> dict[str, Any]:
    """Extract part `index` (`rank`'s `label`); returns its `ExtractResult` as JSON (sizes,
    content hash, CRC ledger)."""
    meter = TaskMeter()
    j = job_of(job)
    plan, storage, options, work = context(j)
    result = extract_unit(
        plan, index, storage, work, options, on_bytes=lambda n: progress().advance(n, "extract")
    ).to_json()
    record_run(j, "extract", index, result, meter)
    return result


def extract_is_present(job: dict[str, Any], index: int, content_sha256: str | None = None) -> bool:
    """Whether part `index`'s intermediate is on disk, whole, with the recorded content."""
    plan, storage, _, work = context(job_of(job))
    return intermediate_is_present(plan, storage, work, index, content_sha256)
