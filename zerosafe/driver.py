"""The in-process driver: one conversion job in the command's own process
(`convert_checkpoint`).

It plans, holds the work area, then runs the job's units with the one scheduler
(`zerosafe.run.job.run_job`) on the command's executor (`zerosafe.run.local`: threads or
worker processes), with the same leases, cleanup and summary as the flow `convert` in
`zerosafe_app`; each finished unit is recorded in the work area
(`zerosafe.run.unit_records`), so a killed run started again resumes.
"""

from __future__ import annotations

import functools
import logging
import time

from zerosafe.cast import output_needs_torch
from zerosafe.config import ConvertOptions
from zerosafe.io.storage import Storage, normalize_url
from zerosafe.pipeline import hold_destination, hold_work, plan_job_and_load
from zerosafe.run.job import RunSettings, run_job
from zerosafe.run.local import open_local
from zerosafe.run.progress import NullProgress, Progress
from zerosafe.run.workers import prestart
from zerosafe.stages.results import RunSummary

__all__ = ["convert_checkpoint"]

log = logging.getLogger(__name__)


def convert_checkpoint(
    ckpt_url: str,
    out_url: str,
    options: ConvertOptions | None = None,
    *,
    tag: str | None = None,
    storage: Storage | None = None,
    work_url: str | None = None,
    progress: Progress | None = None,
    workers: str | None = None,
    settings: RunSettings | None = None,
) -> RunSummary:
    """Convert a checkpoint tag into verified safetensors in `out_url`, in this process.

    The same steps as the flow `convert`, on the command's executor (`zerosafe.run.local`):
    the same leases, the same cleanup and the same summary.

    Args:
        ckpt_url: The checkpoint folder (holding `latest`) or a tag folder.
        out_url: The output folder.
        options: Output dtype, shard size, memory budget, tied/frozen policy, direct mode.
        tag: The tag to convert instead of the one `latest` names.
        storage: Storage to read and write through (its counter records the bytes).
        work_url: Where to keep the plan and intermediates; by default inside `out_url`.
        progress: Receives byte progress.
        workers: How units run: `threads`, `processes`, or `auto` (processes for a job big
            enough to pay for them); overrides `settings.workers`. Processes need the
            caller's script to start under an `if __name__ == "__main__":` guard (the
            forkserver imports it).
        settings: How units and their copies run (`RunSettings`; the `zerosafe` command
            passes what `ZEROSAFE_WORKERS` and `ZEROSAFE_COPY` say, with `auto` workers by
            default); by default threads and `auto` copies. The engine reads no environment
            variable: `RunSettings.from_environ(os.environ)` does, where a caller wants it.

    Returns:
        The run's summary (`RunSummary.to_json()` for JSON).

    Raises:
        ConversionError: For bad input or options, an output that may not be replaced, a
            live run holding the output or work area, or a failed check.
    """
    options = options or ConvertOptions()
    storage = storage or Storage()
    settings = settings or RunSettings()
    if workers is not None:
        settings = RunSettings(workers=workers.strip().lower(), copy=settings.copy)
    # the workers' interpreter and imports, overlapped with planning
    prestart(settings.workers, torch=output_needs_torch(options.dtype))
    ckpt_url, out_url = normalize_url(ckpt_url), normalize_url(out_url)
    work_url = normalize_url(work_url) if work_url else None
    started = time.monotonic()
    with hold_destination(storage, ckpt_url, out_url) as out_lease:
        job, plan = plan_job_and_load(
            storage, ckpt_url, out_url, options, tag=tag, work_url=work_url
        )
        if plan is None:
            return RunSummary.already_complete(out_url, job.job_key)
        for warning in job.warnings:
            log.warning("%s", warning)
        with hold_work(storage, job) as work_lease:
            opener = functools.partial(
                open_local, job, plan, storage, options, settings=settings,
                progress=progress or NullProgress(),
            )  # fmt: skip
            return run_job(
                job, plan, storage, options, run_id=work_lease.run_id, started=started,
                leases=(out_lease, work_lease),
                open_executor=lambda reused, stages: opener(reused=reused, stages=stages),
            )  # fmt: skip
