"""Stage 3: write one output shard, streaming its tensors' fragments in order."""

from __future__ import annotations

from typing import Any

from prefect import task

from zerosafe.formats.safetensors import HeaderEntry, build_header
from zerosafe.pipeline import merge_or_reuse
from zerosafe.stages import output
from zerosafe.stages.output import shard_location
from zerosafe.stages.shards import DirectLocator, StagedLocator, shard_metadata
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
    """Merge shard `index` (shown as `number`/`count`). `fingerprint` names the content of
    the intermediates it reads, so a re-extracted identical file keeps this result cached."""
    meter = TaskMeter()
    j = job_of(job)
    plan, storage, options, work = context(j)
    if options.direct:
        locator: DirectLocator | StagedLocator = DirectLocator(plan, storage)
    else:
        locator = StagedLocator(plan, storage, work.intermediate)
    try:
        summary = merge_or_reuse(
            plan, index, storage, j.destination, locator, chunk_bytes=options.chunk_bytes,
            on_bytes=lambda n: progress().advance(n, "merge"),
        )  # fmt: skip
    finally:
        locator.close()
    record_run(j, "merge", index, summary, meter)
    return summary


def expected_shard_bytes(job: dict[str, Any], index: int) -> int:
    """The exact size shard `index` has when written (header + data)."""
    plan, _, _, _ = context(job_of(job))
    tensors = plan.shard_tensors(index)
    header = build_header(
        [HeaderEntry(t.name, t.out_dtype, t.shape) for t in tensors], shard_metadata(plan, index)
    )
    return len(header) + plan.shards[index].data_bytes


def shard_identity(job: dict[str, Any], index: int) -> tuple[int, str] | None:
    """(size, version) of shard `index` on disk (pending, else published), or None."""
    plan, storage, _, _ = context(job_of(job))
    url = shard_location(storage, job["destination"], plan.plan_id, plan.shards[index].file_name)
    if not storage.exists(url):
        return None
    ident = storage.identity(url)
    return ident.size_bytes, ident.version


def reusable_shards(job: dict[str, Any]) -> set[int]:
    """In a repair: the shards that are published and still intact (nothing to merge)."""
    plan, storage, _, _ = context(job_of(job))
    return output.reusable_shards(storage, job["destination"], plan)
