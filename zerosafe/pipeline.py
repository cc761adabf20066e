"""One conversion job's lifecycle as plain functions.

A job, step by step (`zerosafe.driver.convert_checkpoint` runs it in one process, one unit
at a time, recording each finished unit in the work area so that a killed run resumes; the flow
`convert` in `zerosafe_app` schedules the very same functions as cached, retried, parallel
Prefect tasks):

1. `hold_destination`: one job at a time per output folder, from before it is looked at.
2. `plan_job`: nothing to do if the output already holds this conversion; else plan, settle
   the output folder (`--overwrite`, repair), check free space and save the plan: a `JobPlan`.
3. `hold_work`: one run at a time per work area.
4. The units of work: `extract_unit` per part (staged mode); `merge_unit` per shard once the
   parts it reads are extracted (`MergeReadiness`); `verify_unit` per shard once it is merged.
5. `publish_job`: the CRC ledgers, the optional 16-bit check, the index, the manifest and,
   last, the completion marker (a failed check discards the run's work); a publish whose
   marker is written is a no-op, so it is safe to retry. Then `finish_job` removes the work
   files, a step of its own: where it fails the output is still complete, and the run warns
   (`cleanup_warning`) instead of failing. `summarize` makes the `RunSummary`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from zerosafe.cast import output_needs_torch
from zerosafe.config import PIPELINE_BUFFERS, ConvertOptions
from zerosafe.errors import IntegrityError, StorageError, VerificationError
from zerosafe.formats.safetensors import HeaderEntry, build_header
from zerosafe.io.lease import Lease, destination_lease, work_lease
from zerosafe.io.residency import serial_merge_reason
from zerosafe.io.storage import Storage, is_local, join_url, local_path
from zerosafe.plan.build import plan_checkpoint
from zerosafe.plan.model import Plan, save_plan
from zerosafe.run.unit_records import fingerprint
from zerosafe.run.workers import process_options
from zerosafe.stages.destination import check_output_apart, check_output_kind
from zerosafe.stages.model_files import model_files_folder
from zerosafe.stages.output import (
    default_work_url,
    discard_failed_work,
    finish_work,
    pending_url,
    prepare_output,
    quick_done,
    read_complete_manifest,
    reusable_shard,
    reusable_shards,
    shard_location,
)
from zerosafe.stages.output import publish as publish_output
from zerosafe.stages.results import (
    ExtractResult,
    JobPlan,
    MergeResult,
    PartWork,
    PublishResult,
    RunStats,
    RunSummary,
    ShardWork,
    TensorRecords,
    VerifyResult,
)
from zerosafe.stages.shards import (
    DirectLocator,
    StagedLocator,
    check_integrity,
    extract_part,
    merge_shard,
    read_intermediate_sums,
    shard_metadata,
)
from zerosafe.stages.streaming import FUSED_STREAM_BYTES, CopyPolicy
from zerosafe.units import format_bytes
from zerosafe.verify.output import lowp_report
from zerosafe.verify.tensors import verify_shard

if TYPE_CHECKING:
    from zerosafe.formats.crc import IntegrityReport
    from zerosafe.stages.manifest import Manifest

__all__ = [
    "MergeReadiness",
    "WorkLayout",
    "check_free_space",
    "cleanup_warning",
    "expected_shard_bytes",
    "extract_unit",
    "finish_job",
    "hold_destination",
    "hold_work",
    "intermediate_is_present",
    "merge_fingerprint",
    "merge_streams",
    "merge_unit",
    "open_locator",
    "parts_to_extract",
    "peak_rss_bytes",
    "plan_job",
    "plan_job_and_load",
    "publish_job",
    "run_stats",
    "shard_identity",
    "stage_bytes",
    "summarize",
    "unit_process_options",
    "unit_key_options",
    "verify_fingerprint",
    "verify_unit",
]

log = logging.getLogger(__name__)

OnBytes = Callable[[int], None] | None


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


# -- 1. and 3. leases -----------------------------------------------------------------------------


@contextlib.contextmanager
def hold_destination(storage: Storage, source: str, destination: str) -> Iterator[Lease]:
    """Hold the output folder for this job, from before it is inspected (and, with
    `--overwrite`, cleared) until it is published; yields the `Lease` (`check` it before
    publishing).

    Raises:
        ConfigError: If `destination` is the checkpoint folder, inside it or holds it.
        LeaseHeldError: If another live run converts into `destination`.
    """
    check_output_apart(storage, source, destination)  # before the lease, the first write
    job = f"{source} -> {destination}"
    with destination_lease(storage, destination, job=job, clean=[destination]) as lease:
        yield lease


@contextlib.contextmanager
def hold_work(storage: Storage, job: JobPlan) -> Iterator[Lease]:
    """Hold the job's work area for this run (it may live outside the output folder, with
    `--work-dir`); removes temporary files a killed run left there. Yields the `Lease`.

    Raises:
        LeaseHeldError: If another live run of this job works there.
    """
    clean = [pending_url(job.destination, job.job_key), join_url(job.work_url, "intermediate")]
    with work_lease(storage, job.work_url, clean=clean) as lease:
        yield lease


# -- 2. plan --------------------------------------------------------------------------------------


def _same_device(a: str, b: str) -> bool:
    def dev(path: str) -> int:
        path = os.path.abspath(local_path(path))
        while not os.path.exists(path):
            path = os.path.dirname(path)
        return os.stat(path).st_dev

    return is_local(a) and is_local(b) and dev(a) == dev(b)


def check_free_space(
    storage: Storage,
    plan: Plan,
    out_url: str,
    work_url: str,
    *,
    direct: bool,
    kept: Collection[int] = (),
) -> None:
    """Refuse to start when the output (and, staged, the intermediates) cannot fit.

    Args:
        kept: Shards a repair keeps as published (`reusable_shards`): they need no new space,
            nor do the extract parts only they read.

    Raises:
        StorageError: Naming the path, the bytes needed and the bytes free.
    """
    out_bytes = sum(s.data_bytes for s in plan.shards if s.index not in kept)
    work_bytes = 0 if direct else plan.slot_bytes
    if kept and not direct:
        parts = {
            p
            for s, shard_parts in zip(plan.shards, plan.shard_parts(), strict=True)
            if s.index not in kept
            for p in shard_parts
        }
        work_bytes = sum(plan.part_bytes(p) for p in parts)
    needs = [(out_url, out_bytes), (work_url, work_bytes)]
    if _same_device(out_url, work_url):
        needs = [(out_url, out_bytes + work_bytes)]
    for url, need in needs:
        free = storage.free_bytes(url)
        if free is not None and need > free:
            raise StorageError(
                f"{url}: the conversion needs {format_bytes(need)} there but only "
                f"{format_bytes(free)} is free. Free space, choose another output"
                + (
                    ""
                    if direct
                    else ", or use --mode direct (no intermediate copy) for a local source"
                )
                + ", then run the same command again."
            )


def plan_job(
    storage: Storage,
    source: str,
    destination: str,
    options: ConvertOptions,
    *,
    tag: str | None = None,
    work_url: str | None = None,
) -> JobPlan:
    """Decide what the job does: nothing (`state == "done"`: the output already holds this
    conversion), or convert; then the plan is saved in the work area for every unit of work.

    When the output's completion marker and the checkpoint's file stats say it is done, no
    checkpoint byte is read. `--overwrite` clears another conversion here; a complete output
    whose files changed becomes a repair.

    Raises:
        ConversionError: For an unreadable checkpoint, an output holding another conversion
            or another kind of output (`--to universal|dcp`; without `overwrite`), or too
            little free space.
    """
    job, _ = plan_job_and_load(storage, source, destination, options, tag=tag, work_url=work_url)
    return job


def plan_job_and_load(
    storage: Storage,
    source: str,
    destination: str,
    options: ConvertOptions,
    *,
    tag: str | None = None,
    work_url: str | None = None,
) -> tuple[JobPlan, Plan | None]:
    """`plan_job`, also returning the `Plan` itself (None when there is nothing to do)."""
    check_output_kind(storage, destination, "weights", overwrite=options.overwrite)
    done = quick_done(storage, source, tag, destination, options)
    if done is not None:  # this very conversion is complete: no checkpoint byte is read
        return JobPlan(state="done", job_key=done, destination=destination), None
    before = dict(storage.counter.read_by_url)
    layout, plan = plan_checkpoint(storage, source, tag=tag, options=options)
    metadata_bytes_read = sum(
        storage.counter.read_by_url.get(f.url, 0) - before.get(f.url, 0) for f in plan.files
    )
    state = prepare_output(
        storage, destination, plan.job_key, overwrite=options.overwrite,
        model_files_from=model_files_folder(plan.source, options),
        file_sha256=options.file_sha256,
    )  # fmt: skip
    work = WorkLayout(work_url or default_work_url(destination, plan.job_key))
    serial = ""
    if state.kind != "done":
        serial = _serial_merges(plan, options)
        kept = reusable_shards(storage, destination, plan)  # a repair: published, intact
        check_free_space(storage, plan, destination, work.root, direct=options.direct, kept=kept)
        save_plan(plan, storage, work.plan)
    job = JobPlan(
        state=state.kind, job_key=plan.job_key, destination=destination, work_url=work.root,
        source=plan.source,
        parts=tuple(
            PartWork(
                index=p.index, rank=p.rank, label=str(p.number),
                size_bytes=plan.part_bytes(p.index),
            )
            for p in plan.parts
        ),
        shards=tuple(
            ShardWork(
                index=s.index, file_name=s.file_name, data_bytes=s.data_bytes,
                source_bytes=plan.shard_source_bytes(s.index), parts=tuple(parts),
            )
            for s, parts in zip(plan.shards, plan.shard_parts(), strict=True)
        ),
        aliases=dict(plan.aliases), notes=tuple(plan.notes) + ((serial,) if serial else ()),
        warnings=tuple(plan.warnings), fp32_bytes=plan.fp32_bytes,
        metadata_bytes_read=metadata_bytes_read,
        source_bytes_needed=plan.slot_bytes + layout.metadata_bytes,
        task_memory_bytes=options.task_memory_bytes, serial_merges=serial,
    )  # fmt: skip
    return job, (None if job.is_done else plan)


def _serial_merges(plan: Plan, options: ConvertOptions) -> str:
    """Why this job's merges should run one at a time (`serial_merge_reason`), or "": only
    direct merges of a local checkpoint with more than one shard to write can fight over a
    disk, and only when more than one task may run at once."""
    if not options.direct or options.parallel_tasks < 2 or len(plan.shards) < 2:
        return ""
    if not all(is_local(f.url) for f in plan.files):
        return ""
    return serial_merge_reason(
        [(local_path(plan.files[s.file].url), s.byte_offset, s.nbytes) for s in plan.slots]
    )


# -- 4. the units of work and their order ---------------------------------------------------------


def parts_to_extract(job: JobPlan, *, direct: bool, reused: Collection[int] = ()) -> list[PartWork]:
    """The extract parts this run needs: none in direct mode; in a repair, none that only
    shards kept as published read."""
    if direct:
        return []
    needed = {p for s in job.shards if s.index not in reused for p in s.parts}
    return [p for p in job.parts if p.index in needed]


def unit_process_options(
    job: JobPlan,
    storage: Storage,
    options: ConvertOptions,
    *,
    mode: str,
    reused: Collection[int] = (),
) -> ConvertOptions | None:
    """The options a run's units take in worker processes (`zerosafe.run.workers`), or
    None to keep threads: by `mode` and what the run has to do (`process_options`), never for
    merges that must run one at a time (a rotational disk) or a storage that is not the local
    one (a worker rebuilds its storage from options; a remote one keeps its own connections)."""
    if job.serial_merges or type(storage) is not Storage:
        return None
    todo = [s for s in job.shards if s.index not in reused]
    parts = parts_to_extract(job, direct=options.direct, reused=reused)
    return process_options(
        options, units=len(todo) + len(parts),
        nbytes=sum(s.source_bytes for s in todo) + sum(p.size_bytes for p in parts), mode=mode,
        torch=output_needs_torch(options.dtype),
    )  # fmt: skip


class MergeReadiness:
    """Which shards can be merged now: a shard waits for the extract parts it reads (staged
    mode); in direct mode, or when a repair keeps it as published, for nothing.

    `ready()` hands out the shards that wait for nothing, `part_done(part)` those that waited
    only for `part` still; each shard is handed out once.
    """

    def __init__(
        self, shards: Sequence[ShardWork], *, direct: bool, reused: Collection[int] = ()
    ) -> None:
        self._waiting = {
            s.index: set() if direct or s.index in reused else set(s.parts) for s in shards
        }
        self._shards_of_part: dict[int, list[int]] = {}
        for shard, parts in self._waiting.items():
            for part in parts:
                self._shards_of_part.setdefault(part, []).append(shard)

    def ready(self) -> list[int]:
        """Shards waiting for nothing (now handed out)."""
        return self._take([s for s, parts in self._waiting.items() if not parts])

    def part_done(self, part: int) -> list[int]:
        """Shards that became ready as `part` was extracted (now handed out)."""
        for shard in self._shards_of_part.pop(part, []):
            if shard in self._waiting:
                self._waiting[shard].discard(part)
        return self.ready()

    @property
    def waiting(self) -> list[int]:
        """Shards not handed out yet."""
        return sorted(self._waiting)

    def _take(self, shards: list[int]) -> list[int]:
        for shard in shards:
            del self._waiting[shard]
        return sorted(shards)


def stage_bytes(job: JobPlan, parts: Sequence[PartWork], *, direct: bool) -> dict[str, int]:
    """The bytes each stage handles this run (for progress)."""
    return {
        "extract": 0 if direct else sum(p.size_bytes for p in parts),
        "merge": sum(s.source_bytes for s in job.shards),
        "verify": sum(s.data_bytes for s in job.shards),
    }


def extract_unit(
    plan: Plan,
    part: int,
    storage: Storage,
    work: WorkLayout,
    options: ConvertOptions,
    *,
    on_bytes: OnBytes = None,
    copy: CopyPolicy | None = None,
) -> ExtractResult:
    """Copy extract part `part` from the checkpoint into the work area's intermediates
    (`copy`: how the run's copies run)."""
    return extract_part(
        plan, part, storage, work.intermediate, chunk_bytes=options.chunk_bytes,
        on_bytes=on_bytes, copy=copy,
    )  # fmt: skip


def open_locator(
    plan: Plan, storage: Storage, work: WorkLayout, options: ConvertOptions
) -> DirectLocator | StagedLocator:
    """Where merges read slots: the checkpoint itself (direct) or the intermediates."""
    if options.direct:
        return DirectLocator(plan, storage)
    return StagedLocator(plan, storage, work.intermediate)


def merge_unit(
    plan: Plan,
    shard: int,
    storage: Storage,
    destination: str,
    work: WorkLayout,
    options: ConvertOptions,
    *,
    on_bytes: OnBytes = None,
    locator: DirectLocator | StagedLocator | None = None,
    streams: int = 1,
    copy: CopyPolicy | None = None,
) -> MergeResult:
    """Merge output shard `shard` into the job's pending folder, or, in a repair, keep the
    published shard when it is still as published.

    Args:
        locator: Shared by several merges (the sequential driver); by default one of its own.
        streams: Threads copying at once within the shard (`merge_streams`).
        copy: How the run's copies run (`zerosafe.stages.streaming.CopyPolicy`).
    """
    file_name = plan.shards[shard].file_name
    reused = reusable_shard(storage, destination, plan.job_key, shard, file_name)
    if reused is not None:
        log.info("%s: still as published; kept", join_url(destination, file_name))
        return reused
    reader = open_locator(plan, storage, work, options) if locator is None else locator
    try:
        return merge_shard(
            plan, shard, storage, pending_url(destination, plan.job_key), reader,
            chunk_bytes=options.chunk_bytes, on_bytes=on_bytes, streams=streams, copy=copy,
        )  # fmt: skip
    finally:
        if locator is None:
            reader.close()


MAX_MERGE_STREAMS = 8


def merge_streams(position: int, total: int, at_once: int, options: ConvertOptions) -> int:
    """Threads for the merge that is `position`-th of `total` started with `at_once` tasks:
    1, except where too few merges are left to keep every task busy. A run of `total`
    merges on `at_once` tasks ends in a round of `total % at_once` of them (or is one round
    of `total < at_once`); each of those gets `at_once // round` streams, so that the cores of
    the tasks left without a shard copy its tensors (on 16 cores, 35 shards left 3 to run
    alone for a third of the run). At most `MAX_MERGE_STREAMS`, and as many as the task's
    copy buffers hold (`FUSED_STREAM_BYTES` each)."""
    last_round = total % at_once if total >= at_once else total
    if at_once < 2 or last_round == 0 or position < total - last_round:
        return 1
    fits = options.chunk_bytes * PIPELINE_BUFFERS // FUSED_STREAM_BYTES
    return max(1, min(at_once // last_round, MAX_MERGE_STREAMS, fits))


def verify_unit(
    plan: Plan,
    shard: int,
    storage: Storage,
    destination: str,
    options: ConvertOptions,
    *,
    expected: TensorRecords,
    on_bytes: OnBytes = None,
) -> VerifyResult:
    """Check shard `shard` with the independent reader against what its merge recorded;
    with `options.file_sha256`, the same re-read also hashes the whole file (the only time
    a conversion computes it)."""
    started = time.monotonic()
    url = shard_location(storage, destination, plan.job_key, plan.shards[shard].file_name)
    report = verify_shard(
        storage, url, expected=expected, allow_nonfinite=options.allow_nonfinite,
        chunk_bytes=options.chunk_bytes, on_bytes=on_bytes, file_sha256=options.file_sha256,
    )  # fmt: skip
    return VerifyResult(
        shard=shard, file=report.file, num_tensors=len(report.tensors), tensors=report.tensors,
        metadata=report.metadata, failures=tuple(f.as_dict() for f in report.failures),
        bytes_read=report.bytes_read, seconds=round(time.monotonic() - started, 3),
        sha256=report.sha256,
    )  # fmt: skip


# -- what is on disk: whether a cached result still holds ------------------------------------------


def intermediate_is_present(
    plan: Plan, storage: Storage, work: WorkLayout, part: int, content_sha256: str | None = None
) -> bool:
    """Whether part `part`'s intermediate is on disk, whole, with the recorded content."""
    sums = read_intermediate_sums(storage, work.intermediate, plan.parts[part])
    return sums is not None and (content_sha256 is None or sums.content_sha256 == content_sha256)


def expected_shard_bytes(plan: Plan, shard: int) -> int:
    """The exact size shard `shard` has when written (header + data)."""
    entries = [HeaderEntry(t.name, t.out_dtype, t.shape) for t in plan.shard_tensors(shard)]
    return len(build_header(entries, shard_metadata(plan, shard))) + plan.shards[shard].data_bytes


def shard_identity(
    plan: Plan, storage: Storage, destination: str, shard: int
) -> tuple[int, str] | None:
    """(size, version) of shard `shard` on disk (pending, else published), or None."""
    url = shard_location(storage, destination, plan.job_key, plan.shards[shard].file_name)
    if not storage.exists(url):
        return None
    ident = storage.identity(url)
    return ident.size_bytes, ident.version


# -- 5. publish, finish, summarize ---------------------------------------------------------------


def run_stats(
    job: JobPlan,
    options: ConvertOptions,
    *,
    extracts: Sequence[ExtractResult],
    merges: Sequence[MergeResult],
    verifies: Sequence[VerifyResult],
    seconds: float,
    tasks_executed: dict[str, int],
    peak_rss_bytes: int,
    rss_growth_bytes_by_stage: dict[str, int] | None = None,
    rss_baseline_bytes: int = 0,
) -> RunStats:
    """The run's stats from its results (so they add up across workers), before publish adds
    the bytes its CRC checks read."""
    copied = (
        sum(m.bytes_read for m in merges) if options.direct else sum(e.bytes_read for e in extracts)
    )
    intermediate_written = sum(e.file_bytes for e in extracts)
    output_written = sum(m.file_bytes for m in merges)
    from_intermediates = 0 if options.direct else sum(m.bytes_read for m in merges)
    source_read = job.metadata_bytes_read + copied
    return RunStats(
        mode="direct" if options.direct else "staged", mode_reason=options.mode_reason,
        source_bytes_read=source_read, source_bytes_needed=job.source_bytes_needed,
        intermediate_bytes_written=intermediate_written, output_bytes_written=output_written,
        bytes_read=source_read + from_intermediates + sum(v.bytes_read for v in verifies),
        bytes_written=intermediate_written + output_written, fp32_bytes=job.fp32_bytes,
        rss_growth_bytes_by_stage=dict(rss_growth_bytes_by_stage or {}),
        rss_baseline_bytes=rss_baseline_bytes, tasks_executed=dict(tasks_executed),
        peak_rss_bytes=peak_rss_bytes, seconds=round(seconds, 3),
    )  # fmt: skip


def _with_gap_bytes(stats: RunStats, gap_bytes: int) -> RunStats:
    source_read = stats.source_bytes_read + gap_bytes
    ratio = round(source_read / stats.source_bytes_needed, 4) if stats.source_bytes_needed else None
    return replace(
        stats,
        source_bytes_read=source_read,
        bytes_read=stats.bytes_read + gap_bytes,
        source_read_ratio=ratio,
    )


def publish_job(
    plan: Plan,
    storage: Storage,
    destination: str,
    work: WorkLayout,
    options: ConvertOptions,
    *,
    extracts: Sequence[ExtractResult],
    merges: Sequence[MergeResult],
    verifies: Sequence[VerifyResult],
    stats: RunStats,
) -> PublishResult:
    """Check every record read against its CRC, run the optional 16-bit check, then write
    the index, the manifest and, last, the completion marker.

    A failed check is never kept: the run's intermediates, cached results and pending shards
    are discarded, so the next run reads the source again.

    A publish whose marker this job already wrote (a retry after the marker) is a no-op
    that returns what the first publish returned, read back from the manifest.

    Raises:
        IntegrityError: If a record read does not match its CRC.
        VerificationError: If a shard (or the 16-bit check) failed; nothing is published.
    """
    published = _already_published(storage, destination, plan.job_key)
    if published is not None:
        log.info("%s: already published by this job; nothing to do", destination)
        return published
    try:
        source_urls = {f.url for f in plan.files}
        read_before = storage.counter.bytes_read_from(source_urls)
        integrity = check_integrity(
            plan, storage, [e.ledger for e in extracts] + [m.ledger for m in merges],
            intermediate_url=None if options.direct else work.intermediate,
        ).report()  # fmt: skip
        # CRC checks read the few source bytes no copy covered: count them with the rest.
        stats = _with_gap_bytes(stats, storage.counter.bytes_read_from(source_urls) - read_before)
        lowp = None
        if options.check_lowp:  # the optional 16-bit witness: reads the module weights too
            lowp = lowp_report(storage, plan.source, destination, merges, job_key=plan.job_key)
        manifest = publish_output(
            plan, storage, destination, options=options, merges=merges, verifies=verifies,
            integrity=integrity, stats=stats, lowp=lowp,
        )  # fmt: skip
        return _result_of(manifest, integrity, stats)
    except (IntegrityError, VerificationError):
        discard_failed_work(storage, destination, plan.job_key, work.root)
        raise


def _already_published(storage: Storage, destination: str, job_key: str) -> PublishResult | None:
    """The result a publish of `job_key` returned, if its marker is written (a repair removes
    the marker at plan time, so a marker of this job here is this run's)."""
    manifest = read_complete_manifest(storage, destination)
    if manifest is None or manifest.job_key != job_key or manifest.stats is None:
        return None
    if manifest.integrity is None:
        return None
    return _result_of(manifest, manifest.integrity, manifest.stats)


def _result_of(manifest: Manifest, integrity: IntegrityReport, stats: RunStats) -> PublishResult:
    return PublishResult(
        files=manifest.file_names,
        num_tensors=len(manifest.tensors),
        integrity=integrity,
        stats=stats,
    )


def finish_job(
    storage: Storage, *, destination: str, job_key: str, work_url: str, keep_work: bool
) -> None:
    """After a publish: remove the pending folder, the work area (unless `keep_work`) and
    the output's work folder once empty. Safe to run again."""
    finish_work(storage, destination, job_key, work_url, keep=keep_work)


def cleanup_warning(destination: str, work_url: str, error: object) -> str:
    """What a run says when its output is published but removing its work files failed: the
    output is complete, so the run does not fail; `zerosafe clean` removes what is left."""
    return (
        f"{destination}: converted and verified, but removing the work files in {work_url} "
        f"failed ({error}); the output is complete. Run `zerosafe clean {destination} "
        "--older-than 0 --apply` to remove them."
    )


def summarize(
    job: JobPlan, published: PublishResult, verifies: Sequence[VerifyResult], *, seconds: float
) -> RunSummary:
    """The run's summary, once published."""
    return RunSummary(
        status="converted", output=job.destination, job_key=job.job_key,
        files=published.files, num_tensors=published.num_tensors, aliases=job.aliases,
        integrity=published.integrity, notes=job.notes, warnings=job.warnings,
        checks_passed=sum(v.num_tensors for v in verifies), stats=published.stats,
        seconds=round(seconds, 3),
        throughput_bytes_per_second=round(published.stats.source_bytes_read / max(seconds, 1e-9)),
    )  # fmt: skip


# -- the sequential driver ------------------------------------------------------------------------


def unit_key_options(options: ConvertOptions) -> dict[str, bool]:
    """The options in a unit's key besides the job key (`zerosafe.run.unit_records.unit_key`)."""
    return {
        "direct": options.direct,
        "allow_nonfinite": options.allow_nonfinite,
        "file_sha256": options.file_sha256,
    }


def merge_fingerprint(
    shard: ShardWork, *, direct: bool, reused: Collection[int], content_sha256: dict[int, str]
) -> str:
    """What a merge reads, for its key: nothing beyond the plan in direct mode or for a shard a
    repair keeps; else the content hashes of the intermediates it reads (so a re-extracted,
    identical intermediate keeps a finished merge)."""
    if shard.index in reused:
        return "reused"
    if direct:
        return ""
    return fingerprint([content_sha256[p] for p in shard.parts])


def verify_fingerprint(
    identity: tuple[int, str] | None, tensors: TensorRecords, *, run_id: str
) -> str:
    """What a verify reads, for its key: the shard's size and version, the checksums its
    merge recorded, and the run (`run_id`: the work lease's, `hold_work`).

    A verify result is never reused from an earlier run: size and version do not see a shard
    damaged in place at the same size and mtime (a zero-filled block after a crash, bit rot
    on NFS) while a killed run's pending shard waited, so every rerun re-reads each shard it
    publishes, in both executors (the driver's unit records and the flow's cached results
    share this key). Within a run (a retried task, a retried publish) the result holds."""
    return fingerprint(identity, tensors, run_id)
