"""Stage 2 (staged mode): copy one part of one rank's fp32 partition to an intermediate file."""

from __future__ import annotations

from zerosafe.pipeline import extract_unit
from zerosafe.stages.results import ExtractResult
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


@stage_task(
    "extract", run_name="extract rank {rank} part {label}", cache_key_fn=cache_key("extract")
)
def extract(job: Job, index: int, rank: int, label: str, fingerprint: str = "") -> ExtractResult:
    """Extract part `index` (`rank`'s `label`): its sizes, content hash and CRC ledger."""
    meter = TaskMeter(job)
    plan, storage, options, work = context(job)
    result = run_unit(
        job,
        plan,
        extract_unit,
        index,
        storage,
        work,
        options,
        on_bytes=lambda n: progress().advance(n, "extract"),
        copy=job.copy_policy(),
    )
    record_run(job, "extract", index, result, meter)
    return result
