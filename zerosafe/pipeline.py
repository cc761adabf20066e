"""All stages in order, in one process: the engine's own driver, with no Prefect.

`flows/convert.py` runs the same stage functions as Prefect tasks (cached, resumable,
parallel); this driver is for library users and for tests of the engine alone.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerosafe.config import ConvertOptions
from zerosafe.errors import IntegrityError, StorageError, VerificationError
from zerosafe.io.lease import destination_lease
from zerosafe.io.storage import Storage, is_local, join_url, local_path, normalize_url
from zerosafe.plan.build import plan_checkpoint
from zerosafe.plan.model import Plan, save_plan
from zerosafe.stages.model_files import model_files_folder
from zerosafe.stages.output import (
    default_work_url,
    discard_failed_work,
    finish_work,
    pending_url,
    prepare_output,
    publish,
    quick_done,
    reusable_shard,
    reusable_shards,
    shard_location,
)
from zerosafe.stages.progress import NullProgress, Progress
from zerosafe.stages.shards import (
    DirectLocator,
    StagedLocator,
    check_integrity,
    extract_part,
    merge_shard,
)
from zerosafe.units import format_bytes
from zerosafe.verify.output import lowp_report
from zerosafe.verify.tensors import verify_shard

__all__ = [
    "WorkLayout",
    "check_free_space",
    "convert_checkpoint",
    "merge_or_reuse",
    "peak_rss_bytes",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkLayout:
    """Where one job keeps its work files."""

    root: str

    @property
    def plan(self) -> str:
        return join_url(self.root, "plan")

    @property
    def intermediate(self) -> str:
        return join_url(self.root, "intermediate")


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _same_device(a: str, b: str) -> bool:
    def dev(path: str) -> int:
        path = os.path.abspath(local_path(path))
        while not os.path.exists(path):
            path = os.path.dirname(path)
        return os.stat(path).st_dev

    return is_local(a) and is_local(b) and dev(a) == dev(b)


def check_free_space(
    storage: Storage, plan: Plan, out_url: str, work_url: str, *, direct: bool
) -> None:
    """Refuse to start when the output (and, staged, the intermediates) cannot fit.

    Raises:
        StorageError: Naming the path, the bytes needed and the bytes free.
    """
    out_bytes = sum(s.data_bytes for s in plan.shards)
    work_bytes = 0 if direct else plan.slot_bytes
    needs = [(out_url, out_bytes), (work_url, work_bytes)]
    if _same_device(out_url, work_url):
        needs = [(out_url, out_bytes + work_bytes)]
    for url, need in needs:
        free = storage.free_bytes(url)
        if free is not None and need > free:
            raise StorageError(
                f"{url}: the conversion needs {format_bytes(need)} there but only "
                f"{format_bytes(free)} is free. Free space, choose another output"
                + ("" if direct else ", or use --direct (no intermediate copy) for a local source")
                + ", then run the same command again."
            )


def _run_stages(
    plan: Plan,
    storage: Storage,
    out_url: str,
    work: WorkLayout,
    options: ConvertOptions,
    progress: Progress,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Extract (staged), merge into pending shards and verify them, one after another."""
    chunk = options.chunk_bytes
    extracts: list[dict[str, Any]] = []
    if options.direct:
        locator: DirectLocator | StagedLocator = DirectLocator(plan, storage)
    else:
        reused = reusable_shards(storage, out_url, plan)
        needed = sorted(
            {p for i, parts in enumerate(plan.shard_parts()) if i not in reused for p in parts}
        )
        progress.start("extract", sum(plan.part_bytes(i) for i in needed))
        for i in needed:
            extracts.append(
                extract_part(
                    plan,
                    i,
                    storage,
                    work.intermediate,
                    chunk_bytes=chunk,
                    on_bytes=progress.advance,
                )  # fmt: skip
            )
        progress.finish()
        locator = StagedLocator(plan, storage, work.intermediate)

    merges = []
    progress.start("merge", plan.slot_bytes)
    try:
        for shard in range(len(plan.shards)):
            merges.append(
                merge_or_reuse(
                    plan,
                    shard,
                    storage,
                    out_url,
                    locator,
                    chunk_bytes=chunk,
                    on_bytes=progress.advance,
                )  # fmt: skip
            )
    finally:
        locator.close()
    progress.finish()

    verifies = []
    progress.start("verify", sum(s.data_bytes for s in plan.shards))
    for m in merges:
        report = verify_shard(
            storage, shard_location(storage, out_url, plan.job_key, m["file"]),
            expected=m["tensors"], allow_nonfinite=options.allow_nonfinite, chunk_bytes=chunk,
            on_bytes=progress.advance,
        )  # fmt: skip
        verifies.append(report.as_dict())
    progress.finish()
    if options.check_lowp:
        verifies.append(lowp_report(storage, plan.source, out_url, merges, job_key=plan.job_key))
    return extracts, merges, verifies


def merge_or_reuse(
    plan: Plan,
    shard: int,
    storage: Storage,
    out_url: str,
    locator: DirectLocator | StagedLocator,
    *,
    chunk_bytes: int,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Merge output shard `shard` into the job's pending folder, or, in a repair, reuse the
    published shard when it is still as published."""
    file_name = plan.shards[shard].file_name
    reused = reusable_shard(storage, out_url, plan.job_key, shard, file_name)
    if reused is not None:
        log.info("%s: still as published; kept", join_url(out_url, file_name))
        return reused
    return merge_shard(
        plan, shard, storage, pending_url(out_url, plan.job_key), locator,
        chunk_bytes=chunk_bytes, on_bytes=on_bytes,
    )  # fmt: skip


def convert_checkpoint(
    ckpt_url: str,
    out_url: str,
    options: ConvertOptions | None = None,
    *,
    tag: str | None = None,
    storage: Storage | None = None,
    work_url: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Convert a ZeRO checkpoint tag into verified safetensors in `out_url`.

    Args:
        ckpt_url: The checkpoint folder (holding `latest`) or a tag folder.
        out_url: The output folder.
        options: Output dtype, shard size, memory budget, tied/frozen policy, direct mode.
        tag: The tag to convert instead of the one `latest` names.
        storage: Storage to read and write through (its counter records the bytes).
        work_url: Where to keep the plan and intermediates; by default inside `out_url`.
        progress: Receives byte progress.

    Returns:
        A JSON-able summary of the run.
    """
    options = options or ConvertOptions()
    storage = storage or Storage()
    ckpt_url, out_url = normalize_url(ckpt_url), normalize_url(out_url)
    work_url = normalize_url(work_url) if work_url else None
    progress = progress or NullProgress()
    started = time.monotonic()
    with destination_lease(storage, out_url, job=f"{ckpt_url} -> {out_url}", clean=[out_url]):
        return _convert_held(
            ckpt_url, out_url, options, tag=tag, storage=storage, work_url=work_url,
            progress=progress, started=started,
        )  # fmt: skip


def _convert_held(
    ckpt_url: str,
    out_url: str,
    options: ConvertOptions,
    *,
    tag: str | None,
    storage: Storage,
    work_url: str | None,
    progress: Progress,
    started: float,
) -> dict[str, Any]:
    done = quick_done(storage, ckpt_url, tag, out_url, options)
    if done is not None:
        return {"status": "already-complete", "output": out_url, "job_key": done}
    _, plan = plan_checkpoint(storage, ckpt_url, tag=tag, options=options)
    for warning in plan.warnings:
        log.warning("%s", warning)
    state = prepare_output(
        storage, out_url, plan.job_key, overwrite=options.overwrite,
        model_files_from=model_files_folder(plan.source, options),
    )  # fmt: skip
    if state.kind == "done":
        return {"status": "already-complete", "output": out_url, "job_key": plan.job_key}
    work = WorkLayout(work_url or default_work_url(out_url, plan.job_key))
    check_free_space(storage, plan, out_url, work.root, direct=options.direct)
    save_plan(plan, storage, work.plan)
    try:
        extracts, merges, verifies = _run_stages(plan, storage, out_url, work, options, progress)
        integrity = check_integrity(
            plan, storage, [e["ledger"] for e in extracts] + [m["ledger"] for m in merges],
            intermediate_url=None if options.direct else work.intermediate,
        ).as_dict()  # fmt: skip
        seconds = time.monotonic() - started
        stats = {
            "seconds": round(seconds, 3),
            "bytes_read": storage.counter.bytes_read,
            "source_bytes_read": storage.counter.bytes_read_from({f.url for f in plan.files}),
            "fp32_bytes": plan.fp32_bytes,
            "bytes_written": storage.counter.bytes_written,
            "peak_rss_bytes": peak_rss_bytes(),
            "mode": "direct" if options.direct else "staged",
            "mode_reason": options.mode_reason,
        }
        manifest = publish(
            plan, storage, out_url, options=options, merges=merges, verifies=verifies,
            integrity=integrity, stats=stats,
        )  # fmt: skip
    except (IntegrityError, VerificationError):
        discard_failed_work(storage, out_url, plan.job_key, work.root)
        raise
    finish_work(storage, out_url, plan.job_key, work.root, keep=options.keep_work)
    return {
        "status": "converted",
        "output": out_url,
        "job_key": plan.job_key,
        "files": [f["file"] for f in manifest["files"]],
        "num_tensors": len(manifest["tensors"]),
        "aliases": plan.aliases,
        "integrity": integrity,
        "notes": plan.notes,
        "warnings": plan.warnings,
        **stats,
    }
