"""Stage 3: write one output shard, streaming its tensors' fragments in order."""

from __future__ import annotations

from typing import Any

from prefect import task

from zerosafe import pipeline
from zerosafe.pipeline import merge_unit
from zerosafe.stages import output
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
    name="merge",
    task_run_name="merge shard {number}/{count}",
    cache_key_fn=cache_key("merge"),
    persist_result=True,
    retries=3,
    retry_delay_seconds=[2, 10, 30],
    retry_condition_fn=is_transient,
)
def merge(
    job: dict[str, Any], index: int, number: int, count: int, fingerprint: str = ""
) -> dict[str, Any]:
    """Merge shard `index` (shown as `number`/`count`); returns its `MergeResult` as JSON.
    `fingerprint` names the content of the intermediates it reads, so a re-extracted
    identical file keeps this result cached."""
    meter = TaskMeter()
    j = job_of(job)
    plan, storage, options, work = context(j)
    result = merge_unit(
        plan, index, storage, j.destination, work, options,
        on_bytes=lambda n: progress().advance(n, "merge"),
    ).to_json()  # fmt: skip
    record_run(j, "merge", index, result, meter)
    return result


def expected_shard_bytes(job: dict[str, Any], index: int) -> int:
    """The exact size shard `index` has when written (header + data)."""
    plan, _, _, _ = context(job_of(job))
    return pipeline.expected_shard_bytes(plan, index)


def shard_identity(job: dict[str, Any], index: int) -> tuple[int, str] | None:
    """(size, version) of shard `index` on disk (pending, else published), or None."""
    plan, storage, _, _ = context(job_of(job))
    return pipeline.shard_identity(plan, storage, job["destination"], index)


def reusable_shards(job: dict[str, Any]) -> set[int]:
    """In a repair: the shards that are published and still intact (nothing to merge)."""
    plan, storage, _, _ = context(job_of(job))
    return output.reusable_shards(storage, job["destination"], plan)
