"""Stage 5: check the CRC ledgers, then write the index, the manifest and, last, the marker."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from zerosafe.errors import IntegrityError, VerificationError
from zerosafe.stages.output import discard_failed_work, finish_work
from zerosafe.stages.output import publish as publish_output
from zerosafe.stages.shards import check_integrity
from zerosafe.verify.output import lowp_report
from zerosafe_app.tasks._common import Job, context, is_transient, job_of, record_run


@task(
    name="publish",
    task_run_name="publish",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=is_transient,
)
def publish(
    job: dict[str, Any],
    extracts: list[dict[str, Any]],
    merges: list[dict[str, Any]],
    verifies: list[dict[str, Any]],
    stats: dict[str, Any],
) -> dict[str, Any]:
    """Publish a verified output. Raises (and writes no marker) if any check failed."""
    j = job_of(job)
    plan, storage, options, work = context(j)
    try:
        return _publish(j, extracts, merges, verifies, stats)
    except (IntegrityError, VerificationError):
        # A failed check is never kept: the next run reads the source again.
        discard_failed_work(storage, j.destination, plan.plan_id, work.root)
        raise


def _publish(
    j: Job,
    extracts: list[dict[str, Any]],
    merges: list[dict[str, Any]],
    verifies: list[dict[str, Any]],
    stats: dict[str, Any],
) -> dict[str, Any]:
    plan, storage, options, work = context(j)
    integrity = check_integrity(
        plan, storage, [e["ledger"] for e in extracts] + [m["ledger"] for m in merges],
        intermediate_url=None if options.direct else work.intermediate,
    ).as_dict()  # fmt: skip
    # CRC checks read the few source bytes no copy covered: count them with the rest.
    gap_bytes = storage.counter.bytes_read_from({f.url for f in plan.files})
    if "source_bytes_read" in stats:
        stats = {**stats, "source_bytes_read": stats["source_bytes_read"] + gap_bytes}
        if stats.get("source_bytes_needed"):
            stats["source_read_ratio"] = round(
                stats["source_bytes_read"] / stats["source_bytes_needed"], 4
            )
    if options.check_lowp:  # the optional 16-bit witness: reads the module weights too
        verifies = [
            *verifies,
            lowp_report(storage, plan.source, j.destination, merges, job_key=plan.plan_id),
        ]
    manifest = publish_output(
        plan, storage, j.destination, options=options, merges=merges, verifies=verifies,
        integrity=integrity, stats=stats,
    )  # fmt: skip
    record_run(j, "publish", 0, {})
    finish_work(storage, j.destination, plan.plan_id, work.root, keep=options.keep_work)
    return {
        "files": [f["file"] for f in manifest["files"]],
        "num_tensors": len(manifest["tensors"]),
        "integrity": integrity,
        "stats": stats,
    }
