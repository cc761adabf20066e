"""Which stage task of one job to submit when: the flow's scheduler.

Extract parts (staged mode) are submitted first. A shard's merge is submitted as soon as the
parts it reads are extracted (`zerosafe.pipeline.MergeReadiness`), and its verify as soon as
its merge is done. With a `limit` (the thread runner: the tasks one worker runs at once),
only that many tasks are in flight and the next one is a verify before a merge before an
extract, so a merged shard is verified next rather than after every task queued before it;
without one (Dask), every ready task is submitted at once and Dask orders them. A job whose
merges should not share the disk (`JobPlan.serial_merges`) runs one merge at a time under a
limit, with verifies (and extracts) beside it.

Before submitting a task the scheduler checks its unit's output on disk and refreshes the
task's cache where it vanished or changed; cache keys are `zerosafe_app.tasks._common.cache_key`
of (stage, job key, unit, the `fingerprint` computed here). A verify's fingerprint holds the
run, so a rerun verifies every shard again (`zerosafe.pipeline.verify_fingerprint`).
"""

from __future__ import annotations

import functools
import logging
import queue
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from zerosafe.pipeline import MergeReadiness, merge_fingerprint, verify_fingerprint
from zerosafe.stages.results import (
    ExtractResult,
    JobPlan,
    MergeResult,
    PartWork,
    VerifyResult,
)
from zerosafe_app.tasks.extract import extract, extract_is_present
from zerosafe_app.tasks.merge import expected_shard_bytes, merge, shard_identity
from zerosafe_app.tasks.verify import verify

__all__ = ["StageResults", "StageScheduler", "Submit"]

log = logging.getLogger(__name__)


class Future(Protocol):
    """What the scheduler needs of a Prefect future (or a `concurrent.futures.Future`)."""

    def result(self) -> Any: ...

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...


class Submit(Protocol):
    """Submits `task(*args, **kwargs)`; `refresh` runs it even if a cached result exists."""

    def __call__(self, task: Any, *args: Any, refresh: bool = False, **kwargs: Any) -> Future: ...


@dataclass
class StageResults:
    """What the stage tasks returned, by unit index."""

    extracts: dict[int, ExtractResult] = field(default_factory=dict)
    merges: dict[int, MergeResult] = field(default_factory=dict)
    verifies: dict[int, VerifyResult] = field(default_factory=dict)
    verify_futures: list[Future] = field(default_factory=list)


class StageScheduler:
    """Runs the extract, merge and verify tasks of one job; see the module docstring.

    Args:
        job: What inspect decided.
        task_job: The JSON job context every task gets (`zerosafe_app.tasks._common.Job`).
        parts: The extract parts this run needs (`zerosafe.pipeline.parts_to_extract`).
        reused: Shards a repair keeps as published (their merges read nothing).
        on_done: Called with (stage, index) as each unit finishes (progress).
        limit: Tasks in flight at most; None for no limit.
        serial_merges: Run one merge at a time (under a `limit` only).
    """

    def __init__(
        self,
        job: JobPlan,
        task_job: dict[str, Any],
        *,
        parts: Sequence[PartWork],
        direct: bool,
        reused: Collection[int],
        submit: Submit,
        on_done: Callable[[str, int], None] = lambda stage, index: None,
        limit: int | None = None,
        serial_merges: bool = False,
    ) -> None:
        self.job, self.task_job, self.direct, self.reused = job, task_job, direct, set(reused)
        self._submit, self._on_done, self._limit = submit, on_done, limit
        self._serial_merges = serial_merges and limit is not None
        self._merges_in_flight = 0
        self._merges_submitted = 0  # of the merges that read: the next one's `position`
        self._readiness = MergeReadiness(job.shards, direct=direct, reused=reused)
        self._ready: dict[str, deque[Callable[[], None]]] = {
            "verify": deque(), "merge": deque(), "extract": deque(),
        }  # fmt: skip
        self._done: queue.Queue[tuple[str, int, Future]] = queue.Queue()
        self._in_flight = 0
        self._futures: dict[tuple[str, int], Future] = {}
        self._rechecked: set[int] = set()
        self.results = StageResults()
        for part in parts:
            self._ready["extract"].append(functools.partial(self._extract, part, refresh=None))
        for shard in self._readiness.ready():
            self._ready["merge"].append(functools.partial(self._merge, shard))

    def run(self) -> StageResults:
        """Submit every task as it becomes ready; returns once every one has finished.

        After a failure nothing more is submitted, and every task in flight is waited for
        before the error is raised: the caller releases its leases then, and a task still
        writing would race a next run that takes them (as the sequential driver shuts its
        executor down with `wait=True`).

        Raises:
            Exception: The first failed task's error, once no task of the job runs.
        """
        try:
            self._fill()
            while self._in_flight:
                stage, index, future = self._next_done()
                getattr(self, f"_{stage}_done")(index, future.result())
                self._fill()
        except BaseException:
            self._drain()
            raise
        assert not self._readiness.waiting, f"shards never became ready: {self._readiness.waiting}"
        return self.results

    def _next_done(self) -> tuple[str, int, Future]:
        stage, index, future = self._done.get()
        self._in_flight -= 1
        self._merges_in_flight -= stage == "merge"
        return stage, index, future

    def _drain(self) -> None:
        """Wait for every task in flight to end, whatever its outcome. None waits on the
        failed one: a task is submitted only once the tasks it reads from are done."""
        if self._in_flight:
            log.info("a task failed; waiting for the %d task(s) still running", self._in_flight)
        while self._in_flight:
            self._next_done()

    def _fill(self) -> None:
        while self._limit is None or self._in_flight < self._limit:
            queued = next(
                (q for stage, q in self._ready.items() if q and self._may_start(stage)), None
            )
            if queued is None:
                return
            queued.popleft()()

    def _may_start(self, stage: str) -> bool:
        return stage != "merge" or not self._serial_merges or self._merges_in_flight == 0

    def _watch(self, stage: str, index: int, future: Future) -> None:
        self._in_flight += 1
        self._merges_in_flight += stage == "merge"
        self._futures[(stage, index)] = future
        future.add_done_callback(lambda f: self._done.put((stage, index, f)))

    def _extract(self, part: PartWork, *, refresh: bool | None) -> None:
        fresh = not extract_is_present(self.task_job, part.index) if refresh is None else refresh
        future = self._submit(
            extract, self.task_job, part.index, part.rank, part.label, refresh=fresh
        )
        self._watch("extract", part.index, future)

    def _extract_done(self, index: int, data: dict[str, Any]) -> None:
        result = ExtractResult.from_json(data)
        if index not in self._rechecked and not extract_is_present(
            self.task_job, index, result.content_sha256
        ):
            # A cached result whose file vanished between the check and now: run it again.
            self._rechecked.add(index)
            part = next(p for p in self.job.parts if p.index == index)
            self._ready["extract"].appendleft(functools.partial(self._extract, part, refresh=True))
            return
        self.results.extracts[index] = result
        self._on_done("extract", index)
        for shard in self._readiness.part_done(index):
            self._ready["merge"].append(functools.partial(self._merge, shard))

    def _merge(self, index: int) -> None:
        shard = self.job.shards[index]
        key = merge_fingerprint(
            shard, direct=self.direct, reused=self.reused,
            content_sha256={i: e.content_sha256 for i, e in self.results.extracts.items()},
        )  # fmt: skip
        on_disk = shard_identity(self.task_job, index)
        fresh = on_disk is None or on_disk[0] != expected_shard_bytes(self.task_job, index)
        waits = [
            self._futures[("extract", p)] for p in shard.parts if ("extract", p) in self._futures
        ]
        position = None
        if index not in self.reused:
            position, self._merges_submitted = self._merges_submitted, self._merges_submitted + 1
        future = self._submit(
            merge, self.task_job, index, index + 1, len(self.job.shards),
            fingerprint=key, refresh=fresh, wait_for=waits, position=position,
            merges=len(self.job.shards) - len(self.reused),
        )  # fmt: skip
        self._watch("merge", index, future)

    def _merge_done(self, index: int, data: dict[str, Any]) -> None:
        result = self.results.merges[index] = MergeResult.from_json(data)
        self._on_done("merge", index)
        self._ready["verify"].append(functools.partial(self._verify, index, result))

    def _verify(self, index: int, merged: MergeResult) -> None:
        key = verify_fingerprint(
            shard_identity(self.task_job, index), merged.tensors, run_id=self.task_job["run_id"]
        )
        future = self._submit(
            verify, self.task_job, index, index + 1, len(self.job.shards), merged.tensors,
            fingerprint=key, wait_for=[self._futures[("merge", index)]],
        )  # fmt: skip
        self._watch("verify", index, future)
        self.results.verify_futures.append(future)

    def _verify_done(self, index: int, data: dict[str, Any]) -> None:
        self.results.verifies[index] = VerifyResult.from_json(data)
        self._on_done("verify", index)
