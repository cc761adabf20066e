"""Stage 2 (staged mode): copy one part of one rank's fp32 partition to an intermediate file."""

from __future__ import annotations

from typing import Any

from prefect import task

from zerosafe.stages.shards import extract_part, read_intermediate_sums
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
    """Extract part `index` (`rank`'s `label`); returns sizes, content hash and CRC ledger."""
    meter = TaskMeter()
    j = job_of(job)
    plan, storage, options, work = context(j)
    summary = extract_part(
        plan,
        index,
        storage,
        work.intermediate,
        chunk_bytes=options.chunk_bytes,
        on_bytes=lambda n: progress().advance(n, "extract"),
    )
    record_run(j, "extract", index, summary, meter)
    return summary


def extract_is_present(job: dict[str, Any], index: int, content_sha256: str | None = None) -> bool:
    """Whether part `index`'s intermediate is on disk, whole, with the recorded content."""
    plan, storage, _, work = context(job_of(job))
    sums = read_intermediate_sums(storage, work.intermediate, plan.parts[index])
    return sums is not None and (content_sha256 is None or sums["content_sha256"] == content_sha256)
