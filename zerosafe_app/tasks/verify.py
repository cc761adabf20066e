"""Stage 4: check one written shard independently of the writer."""

from __future__ import annotations

import time
from typing import Any

from prefect import task

from zerosafe.stages.output import shard_location
from zerosafe.verify.tensors import verify_shard
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
    """Verify shard `index` against the checksums its merge recorded (`expected`).

    `fingerprint` holds the file's size and version, so a file changed after a cached
    verification is verified again.
    """
    meter = TaskMeter()
    started = time.monotonic()
    j = job_of(job)
    plan, storage, options, _ = context(j)
    url = shard_location(storage, j.destination, plan.plan_id, plan.shards[index].file_name)
    report = verify_shard(
        storage, url, expected=expected, check_finite=options.check_finite,
        chunk_bytes=options.chunk_bytes, on_bytes=lambda n: progress().advance(n, "verify"),
    ).as_dict()  # fmt: skip
    report["shard"] = index
    report["seconds"] = round(time.monotonic() - started, 3)
    record_run(j, "verify", index, report, meter)
    return report
