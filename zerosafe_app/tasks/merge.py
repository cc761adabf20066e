"""Stage 3: write one output shard, streaming its tensors' fragments in order."""

from __future__ import annotations

from zerosafe.pipeline import merge_unit
from zerosafe.stages.results import MergeResult
from zerosafe_app.tasks._common import (
    Job,
    TaskMeter,
    cache_key,
    context,
    progress,
    record_run,
    run_unit,
)
from zerosafe_app.tasks.edge import stage_task


@stage_task("merge", run_name="merge shard {number}/{count}", cache_key_fn=cache_key("merge"))
def merge(
    job: Job,
    index: int,
    number: int,
    count: int,
    fingerprint: str = "",
    streams: int = 1,
) -> MergeResult:
    """Merge shard `index` (shown as `number`/`count`). `fingerprint` names the content of
    the intermediates it reads, so a re-extracted identical file keeps this result cached.

    `streams`: threads copying at once within the shard, as the scheduler decided from this
    merge's place in the run (`zerosafe.run.schedule`, `zerosafe.pipeline.merge_streams`).
    """
    meter = TaskMeter(job)
    plan, storage, options, work = context(job)
    result = run_unit(
        job, plan, merge_unit, index, storage, job.destination, work, options,
        on_bytes=lambda n: progress().advance(n, "merge"), streams=streams,
        copy=job.copy_policy(),
    )  # fmt: skip
    record_run(job, "merge", index, result, meter)
    return result
