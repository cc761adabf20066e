"""What every stage task shares: the job context, cache keys, retries, the run journal."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from tasks.credentials import storage_for
from zerosafe.config import ConvertOptions
from zerosafe.convert import WorkLayout, peak_rss_bytes
from zerosafe.errors import ConversionError
from zerosafe.plan import Plan, load_plan
from zerosafe.progress import NullProgress, Progress
from zerosafe.s3 import is_transient_error
from zerosafe.storage import Storage, join_url

CACHE_FORMAT = 1
"""Bump when a stage's output bytes change for the same inputs: invalidates old caches."""

_progress: Progress = NullProgress()


def set_progress(progress: Progress) -> None:
    """Where in-process tasks report bytes (the CLI's progress bar)."""
    global _progress
    _progress = progress


def progress() -> Progress:
    return _progress


@dataclass(frozen=True, slots=True)
class Job:
    """The plain-data description every task gets (JSON-able, so Dask can ship it)."""

    source: str
    destination: str
    work: str
    plan_id: str
    options: dict[str, Any]
    storage_options: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def job_of(data: dict[str, Any]) -> Job:
    return Job(**data)


@functools.lru_cache(maxsize=8)
def _plan(work: str, plan_id: str, storage_key: str) -> Plan:
    storage = storage_for(json.loads(storage_key))
    plan = load_plan(storage, WorkLayout(work).plan)
    assert plan.plan_id == plan_id, "work area holds another plan"
    return plan


def context(job: Job) -> tuple[Plan, Storage, ConvertOptions, WorkLayout]:
    """The plan (loaded once per process), a storage, the options and the work layout."""
    key = json.dumps(job.storage_options, sort_keys=True)
    storage = storage_for(job.storage_options)
    return (
        _plan(job.work, job.plan_id, key),
        storage,
        ConvertOptions(**job.options),
        WorkLayout(job.work),
    )


def cache_key(stage: str):  # type: ignore[no-untyped-def]
    """A `cache_key_fn` naming the stage, the plan, the unit and what its inputs hold.

    Keys never collide across stages (the stage is in the key) and change when an input's
    content fingerprint changes. Options that change output bytes are already in the plan id;
    of the rest only those that change a task's result are in the key (`direct` changes what
    a merge reads, `check_finite` what verify reports), so e.g. `--keep-work` or another
    memory budget on a re-run still finds every cached result.
    """

    def key_fn(_ctx: Any, inputs: dict[str, Any]) -> str:
        job = inputs["job"]
        options = job["options"]
        relevant = {"direct": options.get("direct"), "check_finite": options.get("check_finite")}
        blob = json.dumps(
            [
                CACHE_FORMAT,
                stage,
                job["plan_id"],
                inputs.get("index"),
                inputs.get("fingerprint"),
                relevant,
            ],
            sort_keys=True,
        )
        return f"zerosafe-{stage}-{hashlib.sha256(blob.encode()).hexdigest()[:40]}"

    return key_fn


def is_transient(_task: Any, _run: Any, state: Any) -> bool:
    """Retry storage hiccups (S3 throttling and 5xx, timeouts, resets mid-body), never bad
    input, permissions, missing buckets or keys, or full disks (`zerosafe.s3`)."""
    try:
        state.result()
    except ConversionError:
        return False
    except Exception as e:
        return is_transient_error(e)
    return False


def record_run(job: Job, stage: str, index: int, summary: dict[str, Any]) -> None:
    """Write a journal entry (`work/journal/`): which task really executed, where, how long.

    One small file per execution, so processes on many machines never contend for a file.
    """
    entry = {
        "stage": stage,
        "index": index,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "seconds": summary.get("seconds"),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    name = f"{stage}-{index:05d}-{os.getpid()}-{time.time_ns()}.json"
    storage_for(job.storage_options).write_bytes(
        join_url(job.work, "journal", name), json.dumps(entry).encode()
    )


def read_journal(storage: Storage, work: str) -> list[dict[str, Any]]:
    """Every journal entry of a work area, oldest first."""
    folder = join_url(work, "journal")
    entries = [
        json.loads(storage.read_bytes(join_url(folder, n)))
        for n in storage.listdir(folder)
        if n.endswith(".json")
    ]
    return sorted(entries, key=lambda e: e["time"])
