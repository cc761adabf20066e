"""Stage 4: check one written shard independently of the writer."""

from __future__ import annotations

from typing import Any

from zerosafe.pipeline import verify_unit
from zerosafe.stages.results import VerifyResult
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


@stage_task("verify", run_name="verify shard {number}/{count}", cache_key_fn=cache_key("verify"))
def verify(
    job: Job,
    index: int,
    number: int,
    count: int,
    expected: dict[str, Any],
    fingerprint: str = "",
) -> VerifyResult:
    """Verify shard `index` against the checksums its merge recorded (`expected`).

    `fingerprint` holds the file's size and version and the run
    (`zerosafe.pipeline.verify_fingerprint`): a cached result holds within its run only, so
    a rerun verifies every shard again.
    """
    meter = TaskMeter(job)
    plan, storage, options, _ = context(job)
    result = run_unit(
        job, plan, verify_unit, index, storage, job.destination, options, expected=expected,
        on_bytes=lambda n: progress().advance(n, "verify"),
    )  # fmt: skip
    record_run(job, "verify", index, result, meter)
    return result
