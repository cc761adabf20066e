"""Stage 4: check one written shard independently of the writer."""

from __future__ import annotations

from typing import Any

from prefect import task

from zerosafe.pipeline import verify_unit
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
    name="verify",
    task_run_name="verify shard {number}/{count}",
    cache_key_fn=cache_key("verify"),
    persist_result=True,
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=is_transient,
)
def verify(
    job: dict[str, Any],
    index: int,
    number: int,
    count: int,
    expected: dict[str, Any],
    fingerprint: str = "",
) -> dict[str, Any]:
    """Verify shard `index` against the checksums its merge recorded (`expected`); returns
    its `VerifyResult` as JSON.

    `fingerprint` holds the file's size and version, so a file changed after a cached
    verification is verified again.
    """
    meter = TaskMeter()
    j = job_of(job)
    plan, storage, options, _ = context(j)
    result = verify_unit(
        plan, index, storage, j.destination, options, expected=expected,
        on_bytes=lambda n: progress().advance(n, "verify"),
    ).to_json()  # fmt: skip
    record_run(j, "verify", index, result, meter)
    return result
