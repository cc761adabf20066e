"""What every stage task shares: the job context, cache keys, the run journal (the task
decorator and its retry policy are `zerosafe_app.tasks.edge`)."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from zerosafe.cast import output_needs_torch, serial_torch
from zerosafe.config import ConvertOptions
from zerosafe.errors import ConversionError
from zerosafe.io.storage import Storage, join_url
from zerosafe.pipeline import WorkLayout, peak_rss_bytes, unit_key_options
from zerosafe.plan.model import Plan, load_plan
from zerosafe.run.progress import NullProgress, Progress
from zerosafe.run.unit_records import unit_key
from zerosafe.run.workers import Shared, UnitPool
from zerosafe.stages.streaming import CopyPolicy
from zerosafe.units import format_bytes
from zerosafe_app.tasks.credentials import storage_for

_progress: Progress = NullProgress()
_T = TypeVar("_T")


def set_progress(progress: Progress) -> None:
    """Where in-process tasks report bytes (the CLI's progress bar)."""
    global _progress
    _progress = progress


def progress() -> Progress:
    return _progress


class WorkAreaConflictError(ConversionError):
    """The work area holds the plan of another job: two conversions were given one `--work-dir`."""


@dataclass(frozen=True, slots=True)
class Job:
    """What every task gets: plain data and the job's options (picklable, so Dask can ship
    it)."""

    source: str
    destination: str
    work: str
    job_key: str
    options: ConvertOptions
    """The options as the flow validated them once (`JobConfig.options()`), never rebuilt."""
    storage_options: dict[str, Any]
    run_id: str = ""
    """The run holding the work area (`zerosafe.pipeline.hold_work`): journal entries carry
    it, so a run's stats count its own tasks whatever the workers' clocks say."""
    workers: int = 0
    """Worker processes that run this job's units in a process running its tasks (`run_unit`;
    `zerosafe.run.workers`); 0: each task's own thread runs its unit. The flow sets it
    from `ZEROSAFE_WORKERS` (`zerosafe.pipeline.unit_process_options`), with `options`
    then holding the units' share of the budget."""
    copy: str = "auto"
    """How the units' copies run (`zerosafe.stages.streaming.CopyPolicy.mode`): the flow
    reads `ZEROSAFE_COPY` once, where it starts."""

    def copy_policy(self) -> CopyPolicy:
        """The units' copy policy: the tasks that run at once on a machine are the job's
        worker processes, else its parallel tasks."""
        return CopyPolicy(self.copy, self.workers or self.options.parallel_tasks)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def to_json(self) -> dict[str, Any]:
        return self.as_dict()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Job:
        return cls(**data)


class _Summary(Protocol):
    def to_json(self) -> dict[str, Any]: ...


@functools.lru_cache(maxsize=8)
def _plan(work: str, job_key: str, storage_key: str) -> Plan:
    storage = storage_for(json.loads(storage_key))
    url = WorkLayout(work).plan
    plan = load_plan(storage, url)
    if plan.job_key != job_key:
        # Each job plans into its work area before it holds it, so a second job given the
        # same `--work-dir` replaces the first one's plan under its running tasks.
        raise WorkAreaConflictError(
            f"{url}: the work area holds the plan of another job ('{plan.job_key[:16]}', "
            f"expected '{job_key[:16]}'): two conversions were given the same `--work-dir`. "
            "Give each conversion its own `--work-dir` (or none) and run this one again."
        )
    return plan


def context(job: Job) -> tuple[Plan, Storage, ConvertOptions, WorkLayout]:
    """The plan (loaded once per process), a storage, the options and the work layout.

    Every task calls it first; it also has torch run serially in this process, once a cast
    imports it (`serial_torch`): the flow runs tasks in parallel itself, as many as its copies
    are told (`Job.copy_policy`)."""
    serial_torch()
    key = json.dumps(job.storage_options, sort_keys=True)
    storage = storage_for(job.storage_options)
    return (
        _plan(job.work, job.job_key, key),
        storage,
        job.options,
        WorkLayout(job.work),
    )


_pools: dict[tuple[str, str], UnitPool] = {}
_pools_lock = threading.Lock()


def run_unit(job: Job, plan: Plan, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`fn(plan, *args, **kwargs)` (a unit of `zerosafe.pipeline`) in this thread, or in one
    of the job's worker processes when `job.workers` asks for them: started by the first
    unit in this process, fed the plan once, stopped by `close_workers`."""
    if job.workers < 2:
        return fn(plan, *args, **kwargs)
    key = (job.job_key, job.run_id)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = UnitPool(
                job.workers, shared={"plan": plan}, torch=output_needs_torch(job.options.dtype)
            )
            try:
                pool.start()
            except BaseException:
                pool.close()
                raise
            _pools[key] = pool
    result: _T = pool.run(fn, Shared("plan"), *args, **kwargs)
    return result


def workers_peak_rss(job: Mapping[str, Any]) -> int:
    """The peak RSS of the job's worker processes in this process, added up (0: none ran)."""
    with _pools_lock:
        pool = _pools.get((job["job_key"], job["run_id"]))
    return pool.peak_rss_bytes if pool is not None else 0


def close_workers(job: Mapping[str, Any]) -> None:
    """Stop the job's worker processes in this process, if any started."""
    with _pools_lock:
        pool = _pools.pop((job["job_key"], job["run_id"]), None)
    if pool is not None:
        pool.close()


def cache_key(stage: str):  # type: ignore[no-untyped-def]
    """A `cache_key_fn` naming the stage, the plan, the unit and what its inputs hold: the
    engine's `unit_key`, which also keys the in-process driver's unit records, so both paths
    agree on when a finished unit still holds.

    Keys never collide across stages (the stage is in the key) and change when an input's
    content fingerprint changes; another memory budget or `--keep-work` on a rerun still finds
    every cached result.
    """

    def key_fn(_ctx: Any, inputs: dict[str, Any]) -> str:
        job = inputs["job"]
        job = job.as_dict() if isinstance(job, Job) else job
        return unit_key(
            stage, job["job_key"], inputs.get("index"), inputs.get("fingerprint"),
            **unit_key_options(job["options"]),
        )  # fmt: skip

    return key_fn


def current_rss_bytes() -> int:
    """This process's resident set size now (Linux `/proc/self/statm`; elsewhere its peak)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


@functools.cache
def _warm_imports(torch: bool) -> None:
    """Import what the stages import lazily (safetensors and ml_dtypes for verify and casts;
    torch where the casts need it: `zerosafe.cast`), once per process, before the first
    task's memory baseline: a one-time import of some 190 MB is the process's baseline, not
    the working memory of whichever stage ran first."""
    import ml_dtypes  # noqa: F401
    import safetensors  # noqa: F401

    if torch:
        import torch as _  # noqa: F401


class TaskMeter:
    """Time and memory of one task run: the process's RSS when it started and the highest RSS
    sampled (every 10 ms, on a thread) while it ran. A stage's peak is the most one of its
    tasks raised the RSS above where it started; the process's lifetime peak (`ru_maxrss`)
    can only grow from task to task, so it says nothing about one stage."""

    def __init__(self, job: Job, every_s: float = 0.01) -> None:
        _warm_imports(output_needs_torch(job.options.dtype))
        self._every_s = every_s
        self._stop = threading.Event()
        self.started = time.monotonic()
        self.rss_start_bytes = self.rss_peak_bytes = current_rss_bytes()
        self._thread = threading.Thread(target=self._sample, name="zerosafe-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._every_s):
            self.rss_peak_bytes = max(self.rss_peak_bytes, current_rss_bytes())

    def stop(self) -> float:
        """Stop sampling; returns the seconds since the task started."""
        self._stop.set()
        self._thread.join()
        self.rss_peak_bytes = max(self.rss_peak_bytes, current_rss_bytes())
        return time.monotonic() - self.started


def _task_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:  # called outside a task run (a unit test of `task.fn`)
        return logging.getLogger("zerosafe.tasks")


def _task_label(stage: str, index: int) -> str:
    try:
        from prefect.runtime import task_run

        return str(task_run.name or f"{stage} {index}")
    except Exception:
        return f"{stage} {index}"


def record_run(
    job: Job,
    stage: str,
    index: int,
    result: _Summary | None = None,
    meter: TaskMeter | None = None,
) -> None:
    """Write a journal entry (`work/journal/`): which task really executed, where, how long,
    and its memory; and log one line saying what it did (bytes, seconds, throughput), which
    the run's logs in the Prefect UI show.

    One small file per execution, so processes on many machines never contend for a file.
    """
    summary = result.to_json() if result is not None else {}
    seconds = meter.stop() if meter is not None else summary.get("seconds")
    entry = {
        "stage": stage,
        "index": index,
        "run_id": job.run_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "seconds": summary.get("seconds", seconds),
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_start_bytes": meter.rss_start_bytes if meter else None,
        "rss_peak_bytes": meter.rss_peak_bytes if meter else None,
    }
    name = f"{stage}-{index:05d}-{os.getpid()}-{time.time_ns()}.json"
    storage_for(job.storage_options).write_bytes(
        join_url(job.work, "journal", name), json.dumps(entry).encode()
    )
    _task_logger().info("%s", task_line(_task_label(stage, index), summary, seconds, meter))


def task_line(
    label: str, summary: dict[str, Any], seconds: float | None, meter: TaskMeter | None
) -> str:
    """`merge shard 3/12: read 1.2 GB, wrote 1.2 GB in 4.1 s (293 MB/s); memory +41 MB`."""
    moved = []
    if summary.get("bytes_read") is not None:
        moved.append(f"read {format_bytes(summary['bytes_read'])}")
    if summary.get("file_bytes") is not None:
        moved.append(f"wrote {format_bytes(summary['file_bytes'])}")
    text = f"{label}: {', '.join(moved) or 'done'}"
    if seconds is not None:
        text += f" in {seconds:.2f} s"
        most = max(summary.get("bytes_read") or 0, summary.get("file_bytes") or 0)
        if most:
            text += f" ({format_bytes(most / max(seconds, 1e-6))}/s)"
    if meter is not None:
        text += f"; memory +{format_bytes(max(0, meter.rss_peak_bytes - meter.rss_start_bytes))}"
    return text


def stage_memory(entries: list[dict[str, Any]]) -> tuple[dict[str, int], int]:
    """Each stage's own peak: the most one of its tasks raised the process's RSS above where
    it was when that task started (so memory kept by earlier stages does not count again).
    Returns (peak growth by stage, the largest process baseline: a process's RSS as the
    first task of this run in it started), from the journal entries of one run."""
    baselines: dict[tuple[str, int], int] = {}
    growth: dict[str, int] = {}
    for e in entries:
        if e.get("rss_start_bytes") is None or e.get("rss_peak_bytes") is None:
            continue
        key = (e["host"], e["pid"])
        baselines[key] = min(baselines.get(key, e["rss_start_bytes"]), e["rss_start_bytes"])
        grew = max(0, e["rss_peak_bytes"] - e["rss_start_bytes"])
        growth[e["stage"]] = max(growth.get(e["stage"], 0), grew)
    return growth, max(baselines.values(), default=0)


def read_journal(storage: Storage, work: str, *, run_id: str | None = None) -> list[dict[str, Any]]:
    """The journal entries of a work area, oldest first (by each writer's clock).

    Args:
        run_id: Only the entries of this run (`Job.run_id`); every entry when None. Runs are
            told apart by id, never by time: workers' clocks need not agree with the flow's.
    """
    folder = join_url(work, "journal")
    entries = [
        json.loads(storage.read_bytes(join_url(folder, n)))
        for n in storage.listdir(folder)
        if n.endswith(".json")
    ]
    if run_id is not None:
        entries = [e for e in entries if e.get("run_id") == run_id]
    return sorted(entries, key=lambda e: e["time"])
