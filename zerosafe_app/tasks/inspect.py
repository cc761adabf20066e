"""Stage 1: read the checkpoint's pickles, plan the conversion, store the plan as Parquet."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from zerosafe.config import ConvertOptions
from zerosafe.pipeline import WorkLayout, check_free_space
from zerosafe.plan.build import plan_checkpoint
from zerosafe.plan.model import plan_summary, save_plan
from zerosafe.stages.model_files import model_files_folder
from zerosafe.stages.output import default_work_url, prepare_output, quick_done
from zerosafe_app.tasks._common import is_transient
from zerosafe_app.tasks.credentials import storage_for


@task(
    name="inspect",
    task_run_name="inspect",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=is_transient,
)
def inspect(
    source: str,
    destination: str,
    options: dict[str, Any],
    *,
    tag: str | None = None,
    work_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Plan the job; say `already-complete` when the destination holds this very conversion.

    Never cached: it is cheap (pickles only) and decides what every other task's key is.
    """
    storage = storage_for(storage_options)
    opts = ConvertOptions(**options)
    done = quick_done(storage, source, tag, destination, opts)
    if done is not None:  # this very conversion is complete: no checkpoint byte is read
        return {"job_key": done, "state": "done"}
    layout, plan = plan_checkpoint(storage, source, tag=tag, options=opts)
    state = prepare_output(
        storage, destination, plan.job_key, overwrite=opts.overwrite,
        model_files_from=model_files_folder(plan.source, opts),
    )  # fmt: skip
    work = WorkLayout(work_dir or default_work_url(destination, plan.job_key))
    summary = {**plan_summary(plan), "state": state.kind, "work": work.root}
    if state.kind == "done":
        return summary
    check_free_space(storage, plan, destination, work.root, direct=opts.direct)
    save_plan(plan, storage, work.plan)
    summary["parts"] = [
        {
            "index": p.index,
            "rank": p.rank,
            "label": str(p.number),
            "bytes": plan.part_bytes(p.index),
        }
        for p in plan.parts
    ]
    summary["shards"] = [
        {
            "index": s.index,
            "file": s.file_name,
            "bytes": s.data_bytes,
            "source_bytes": plan.shard_source_bytes(s.index),
            "parts": parts,
        }
        for s, parts in zip(plan.shards, plan.shard_parts(), strict=True)
    ]
    summary["task_memory_bytes"] = opts.task_memory_bytes
    source_urls = {f.url for f in plan.files}
    summary["metadata_bytes_read"] = storage.counter.bytes_read_from(source_urls)
    # The least any conversion reads: the bytes it copies, plus each file's pickle and zip
    # directory. The run summary reports what was read against this.
    summary["source_bytes_needed"] = plan.slot_bytes + layout.metadata_bytes
    return summary
