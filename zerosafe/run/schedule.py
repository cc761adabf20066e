"""The scheduler: which unit of one job runs when, whoever runs it (`Scheduler`).

Extract parts (staged mode) come first. A shard's merge is ready as soon as the parts it
reads are extracted (`zerosafe.pipeline.MergeReadiness`), and its verify as soon as its merge
is done. Under a `Policy.limit` only that many units are in flight and the next one is a
verify before a merge before an extract, so a merged shard is verified next rather than
after every unit queued before it; without one (Dask), every ready unit is handed over at
once and the runner orders them. `Policy.serial_merges` runs one merge at a time (a job whose
merges should not share the disk: `JobPlan.serial_merges`); `Policy.one_copy` one extract or
merge at a time, with a verify beside it (the command at two tasks: the verify re-reads what
the merge just wrote, mostly from the page cache, on the other core).

The scheduler also decides, once for both executors:

- **merge-stream places**: each merge that reads learns its place in the order merges were
  handed over and how many there are (`zerosafe.pipeline.merge_streams`): the last round's
  merges copy in several streams;
- **whether a finished unit still holds**: an extract's intermediate is on disk with the
  recorded content, a merge's shard is on disk with the size and version recorded, a
  verify's key holds the run (`zerosafe.pipeline.verify_fingerprint`), so no verify is
  reused across runs. An executor that keeps its own records (`Executor.kept`) has them
  checked here; one whose cache lives behind its runner (Prefect's) is told to `refresh`
  where the output on disk is not as it should be.

Executors: `zerosafe.run.local.LocalExecutor` (the command's own process: threads or worker
processes, `UnitRecords` as the cache) and `zerosafe_app.flows.schedule.PrefectExecutor`
(Prefect tasks, Prefect's cache, any Prefect task runner).
"""

from __future__ import annotations

import functools
import logging
import queue
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from zerosafe.config import ConvertOptions
from zerosafe.io.storage import Storage
from zerosafe.pipeline import (
    MergeReadiness,
    WorkLayout,
    expected_shard_bytes,
    intermediate_is_present,
    merge_fingerprint,
    merge_streams,
    shard_identity,
    verify_fingerprint,
)
from zerosafe.plan.model import Plan
from zerosafe.stages.results import (
    ExtractResult,
    JobPlan,
    MergeResult,
    PartWork,
    TensorRecords,
    VerifyResult,
)

__all__ = ["DiskChecks", "Executor", "Policy", "StageResults", "Scheduler", "Unit", "UnitFuture"]

log = logging.getLogger(__name__)

StageName = Literal["extract", "merge", "verify"]
STAGES: tuple[StageName, ...] = ("extract", "merge", "verify")


class UnitFuture(Protocol):
    """What the scheduler needs of a running unit: a Prefect future or a
    `concurrent.futures.Future`."""

    def result(self) -> Any: ...

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How many units an executor runs at once, and which may run together."""

    limit: int | None
    """Units in flight at most; None: every ready unit at once (the runner orders them)."""
    at_once: int = 1
    """Units that run at once on one machine: the last round's merge streams count on it."""
    serial_merges: bool = False
    """One merge at a time (under a `limit` only)."""
    one_copy: bool = False
    """One extract or merge at a time, verifies beside it (under a `limit` only)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    """One unit of work, as the scheduler hands it to an executor."""

    stage: StageName
    index: int
    fingerprint: str = ""
    """What the unit reads, for its key (`zerosafe.run.unit_records.unit_key`)."""
    refresh: bool = False
    """Its output on disk is missing or not as expected: a cached result must not be used."""
    part: PartWork | None = None
    """An extract's part."""
    identity: tuple[int, str] | None = None
    """A merge's shard on disk now, (size, version); a kept merge must have recorded it."""
    position: int | None = None
    """A merge's place among the run's merges that read, in the order they were handed
    over (staged merges become ready as their parts are extracted, not in shard order); a
    shard a repair keeps has none."""
    streams: int = 1
    """A merge's copy streams (`zerosafe.pipeline.merge_streams` of its `position`)."""
    expected: TensorRecords | None = None
    """A verify's checksums, as its merge recorded them."""
    waits: tuple[UnitFuture, ...] = ()
    """The units it reads from (done already: a runner that tracks edges may want them)."""


class Executor(Protocol):
    """Runs the units the scheduler hands over.

    Call sequence: `kept(unit)` first (a result an earlier run recorded, or None); if None,
    `submit(unit)`, whose future's result is the unit's result (typed, or its JSON); then
    `unit_done` once the scheduler has taken the result (`kept` tells which way it came).
    """

    policy: Policy
    options: ConvertOptions
    """The options units run with (in worker processes: the budget less their overhead)."""

    def kept(self, unit: Unit) -> Mapping[str, Any] | None: ...

    def submit(self, unit: Unit) -> UnitFuture: ...

    def unit_done(self, stage: StageName, index: int, *, kept: bool) -> None: ...


class DiskChecks:
    """What is on disk for one job's units: the checks behind "does a finished unit still
    hold" (`zerosafe.pipeline`'s `intermediate_is_present`, `shard_identity`)."""

    def __init__(self, plan: Plan, storage: Storage, work: WorkLayout, destination: str) -> None:
        self.plan, self.storage, self.work, self.destination = plan, storage, work, destination

    def extract_present(self, part: int, content_sha256: str | None = None) -> bool:
        return intermediate_is_present(self.plan, self.storage, self.work, part, content_sha256)

    def shard_identity(self, shard: int) -> tuple[int, str] | None:
        return shard_identity(self.plan, self.storage, self.destination, shard)

    def expected_shard_bytes(self, shard: int) -> int:
        return expected_shard_bytes(self.plan, shard)


@dataclass
class StageResults:
    """What the units returned, by unit index, and what ran and what was kept."""

    extracts: dict[int, ExtractResult] = field(default_factory=dict)
    merges: dict[int, MergeResult] = field(default_factory=dict)
    verifies: dict[int, VerifyResult] = field(default_factory=dict)
    verify_futures: list[UnitFuture] = field(default_factory=list)
    executed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    """Units the executor ran (a merge that found its shard still published excluded)."""
    kept: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    """Units an interrupted run had finished, whose record still held (`Executor.kept`)."""

    def ordered(self) -> tuple[list[ExtractResult], list[MergeResult], list[VerifyResult]]:
        return (
            [self.extracts[i] for i in sorted(self.extracts)],
            [self.merges[i] for i in sorted(self.merges)],
            [self.verifies[i] for i in sorted(self.verifies)],
        )

    @property
    def resumed(self) -> str:
        """A note naming the units a killed run had finished (empty when none)."""
        kept = [f"{n} {stage}" for stage, n in self.kept.items() if n]
        if not kept:
            return ""
        return (
            f"resumed: {', '.join(kept)} unit(s) finished by an interrupted run were kept "
            "(their output checked on disk), not run again"
        )


def _typed(cls: Any, data: Any) -> Any:
    return data if isinstance(data, cls) else cls.from_json(data)


class Scheduler:
    """Runs the extract, merge and verify units of one job on `executor`; see the module
    docstring.

    Args:
        job: What inspect decided.
        executor: Who runs the units, and its `Policy`.
        checks: What is on disk.
        parts: The extract parts this run needs (`zerosafe.pipeline.parts_to_extract`).
        direct: Merges read the checkpoint itself.
        reused: Shards a repair keeps as published (their merges read nothing).
        run_id: The run holding the work area (a verify's key holds it).
    """

    def __init__(
        self,
        job: JobPlan,
        executor: Executor,
        checks: DiskChecks,
        *,
        parts: Sequence[PartWork],
        direct: bool,
        reused: Collection[int],
        run_id: str,
    ) -> None:
        self.job, self.executor, self.checks = job, executor, checks
        self.direct, self.reused, self.run_id = direct, set(reused), run_id
        policy = executor.policy
        self._limit = policy.limit
        self._serial_merges = policy.serial_merges and policy.limit is not None
        self._one_copy = policy.one_copy and policy.limit is not None
        self._in_flight: dict[str, int] = dict.fromkeys(STAGES, 0)
        self._merges_started = 0  # of the merges that read: the next one's place
        self._to_merge = max(1, len(job.shards) - len(self.reused))
        self._readiness = MergeReadiness(job.shards, direct=direct, reused=reused)
        self._ready: dict[StageName, deque[Callable[[], None]]] = {
            "verify": deque(), "merge": deque(), "extract": deque(),
        }  # fmt: skip
        self._done: queue.Queue[tuple[StageName, int, UnitFuture]] = queue.Queue()
        self._futures: dict[tuple[str, int], UnitFuture] = {}
        self._rechecked: set[int] = set()
        self.results = StageResults()
        for part in parts:
            self._ready["extract"].append(functools.partial(self._extract, part, refresh=None))
        self._merges_ready(self._readiness.ready())

    def run(self) -> StageResults:
        """Hand every unit over as it becomes ready; returns once every one has finished.

        After a failure nothing more is handed over, and every unit in flight is waited for
        before the error is raised: the caller releases its leases then, and a unit still
        writing would race a next run that takes them.

        Raises:
            Exception: The first failed unit's error, once no unit of the job runs.
        """
        try:
            self._fill()
            while sum(self._in_flight.values()):
                stage, index, future = self._next_done()
                getattr(self, f"_{stage}_done")(index, future.result())
                self._fill()
        except BaseException:
            self._drain()
            raise
        assert not self._readiness.waiting, f"shards never became ready: {self._readiness.waiting}"
        return self.results

    def _next_done(self) -> tuple[StageName, int, UnitFuture]:
        stage, index, future = self._done.get()
        self._in_flight[stage] -= 1
        return stage, index, future

    def _drain(self) -> None:
        """Wait for every unit in flight to end, whatever its outcome. None waits on the
        failed one: a unit is handed over only once the units it reads from are done."""
        if running := sum(self._in_flight.values()):
            log.info("a unit failed; waiting for the %d unit(s) still running", running)
        while sum(self._in_flight.values()):
            self._next_done()

    def _fill(self) -> None:
        while self._limit is None or sum(self._in_flight.values()) < self._limit:
            queued = next(
                (q for stage, q in self._ready.items() if q and self._may_start(stage)), None
            )
            if queued is None:
                return
            queued.popleft()()

    def _may_start(self, stage: StageName) -> bool:
        if stage == "verify":
            return True
        if self._one_copy and self._in_flight["extract"] + self._in_flight["merge"]:
            return False
        return stage != "merge" or not self._serial_merges or self._in_flight["merge"] == 0

    def _start(self, unit: Unit) -> None:
        """Use the executor's record of `unit` where it still holds, else run it."""
        record = self.executor.kept(unit) if not unit.refresh else None
        if record is not None and self._holds(unit, record):
            self.results.kept[unit.stage] += 1
            if unit.stage == "merge":  # one merge fewer to run: the last round is nearer
                self._to_merge = max(1, self._to_merge - 1)
            self._take(unit.stage, unit.index, record["result"], kept=True)
            return
        if unit.stage == "merge" and unit.index not in self.reused:
            position, self._merges_started = self._merges_started, self._merges_started + 1
            streams = merge_streams(
                position, self._to_merge, self.executor.policy.at_once, self.executor.options
            )
            unit = replace(unit, position=position, streams=streams)
        future = self.executor.submit(unit)
        self._in_flight[unit.stage] += 1
        self._futures[(unit.stage, unit.index)] = future
        stage, index = unit.stage, unit.index
        future.add_done_callback(lambda f: self._done.put((stage, index, f)))
        if stage == "verify":
            self.results.verify_futures.append(future)

    def _holds(self, unit: Unit, record: Mapping[str, Any]) -> bool:
        """Whether an earlier run's record of `unit` still describes what is on disk."""
        if unit.stage == "extract":
            kept = ExtractResult.from_json(record["result"])
            return self.checks.extract_present(unit.index, kept.content_sha256)
        if unit.stage == "merge":
            return record.get("identity") == list(unit.identity or ())
        return True  # a verify's key holds the run: a record is this run's own

    def _take(self, stage: StageName, index: int, data: Any, *, kept: bool) -> None:
        if stage == "extract":
            self.results.extracts[index] = _typed(ExtractResult, data)
            self.executor.unit_done(stage, index, kept=kept)
            self._merges_ready(self._readiness.part_done(index))
        elif stage == "merge":
            merged = self.results.merges[index] = _typed(MergeResult, data)
            self.executor.unit_done(stage, index, kept=kept)
            self._ready["verify"].append(lambda: self._verify(index, merged))
        else:
            self.results.verifies[index] = _typed(VerifyResult, data)
            self.executor.unit_done(stage, index, kept=kept)

    def _merges_ready(self, shards: list[int]) -> None:
        for shard in shards:
            self._ready["merge"].append(functools.partial(self._merge, shard))

    def _extract(self, part: PartWork, *, refresh: bool | None) -> None:
        fresh = not self.checks.extract_present(part.index) if refresh is None else refresh
        self._start(Unit(stage="extract", index=part.index, part=part, refresh=fresh))

    def _extract_done(self, index: int, data: Any) -> None:
        result = _typed(ExtractResult, data)
        if index not in self._rechecked and not self.checks.extract_present(
            index, result.content_sha256
        ):
            # A cached result whose file vanished between the check and now: run it again.
            self._rechecked.add(index)
            part = next(p for p in self.job.parts if p.index == index)
            self._ready["extract"].appendleft(lambda: self._extract(part, refresh=True))
            return
        self.results.executed["extract"] += 1
        self._take("extract", index, result, kept=False)

    def _merge(self, index: int) -> None:
        shard = self.job.shards[index]
        content = merge_fingerprint(
            shard, direct=self.direct, reused=self.reused,
            content_sha256={i: e.content_sha256 for i, e in self.results.extracts.items()},
        )  # fmt: skip
        on_disk = self.checks.shard_identity(index)
        fresh = on_disk is None or on_disk[0] != self.checks.expected_shard_bytes(index)
        waits = tuple(
            self._futures[("extract", p)] for p in shard.parts if ("extract", p) in self._futures
        )
        self._start(
            Unit(
                stage="merge", index=index, fingerprint=content, refresh=fresh,
                identity=on_disk, waits=waits,
            )
        )  # fmt: skip

    def _merge_done(self, index: int, data: Any) -> None:
        result = _typed(MergeResult, data)
        if not result.reused:
            self.results.executed["merge"] += 1
        self._take("merge", index, result, kept=False)

    def _verify(self, index: int, merged: MergeResult) -> None:
        content = verify_fingerprint(
            self.checks.shard_identity(index), merged.tensors, run_id=self.run_id
        )
        waits = (self._futures[("merge", index)],) if ("merge", index) in self._futures else ()
        self._start(
            Unit(
                stage="verify", index=index, fingerprint=content, expected=merged.tensors,
                waits=waits,
            )
        )  # fmt: skip

    def _verify_done(self, index: int, data: Any) -> None:
        self.results.executed["verify"] += 1
        self._take("verify", index, data, kept=False)
