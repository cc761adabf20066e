"""The one scheduler (`zerosafe.run.schedule`) on plain values: the command's policy, and the
order and "still holds" decisions it makes for any executor."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, cast

import pytest

from zerosafe.config import ConvertOptions
from zerosafe.run.local import local_policy
from zerosafe.run.schedule import DiskChecks, Policy, Scheduler, Unit
from zerosafe.stages.results import JobPlan, MergeResult, ShardWork, VerifyResult


def _job(shards: int, *, serial: str = "") -> JobPlan:
    return cast(
        JobPlan,
        type(
            "Job",
            (),
            {
                "shards": [
                    ShardWork(index=i, file_name=f"s{i}", parts=(), source_bytes=1, data_bytes=1)
                    for i in range(shards)
                ],
                "parts": [],
                "serial_merges": serial,
            },
        )(),
    )


def test_the_commands_policy_is_the_drivers() -> None:
    """One or two tasks: one copy at a time (a verify beside it); more: N whole units; worker
    processes: N; a rotational disk: one copy at a time whatever the tasks."""
    two = ConvertOptions(max_parallel_tasks=2)
    four = ConvertOptions(max_parallel_tasks=4, memory=4 * 10**9)
    assert local_policy(_job(9), two, to_merge=9) == (
        Policy(limit=2, at_once=2, one_copy=True),
        1,
    )
    assert local_policy(_job(9), four, to_merge=9) == (Policy(limit=4, at_once=4), 4)
    assert local_policy(_job(9), four, to_merge=3)[1] == 3  # no more copies than merges
    assert local_policy(_job(9), two, workers=2, to_merge=9) == (Policy(limit=2, at_once=2), 2)
    assert local_policy(_job(9), two, workers=2, to_merge=1)[1] == 2  # each worker's copies
    serial = local_policy(_job(9, serial="rotational"), four, to_merge=9)
    assert serial == (Policy(limit=2, at_once=4, one_copy=True), 1)


class _Checks:
    def shard_identity(self, shard: int) -> tuple[int, str]:
        return (10, f"v{shard}")

    def expected_shard_bytes(self, shard: int) -> int:
        return 10

    def extract_present(self, part: int, content_sha256: str | None = None) -> bool:
        return True


class _Executor:
    """Runs nothing: each unit completes at once, recorded in order; `records` play the
    unit records an interrupted run left."""

    def __init__(self, policy: Policy, records: dict[tuple[str, int], Mapping[str, Any]]):
        self.policy, self.options, self.records = policy, ConvertOptions(), records
        self.submitted: list[Unit] = []
        self.done: list[tuple[str, int, bool]] = []

    def kept(self, unit: Unit) -> Mapping[str, Any] | None:
        return self.records.get((unit.stage, unit.index))

    def unit_done(self, stage: str, index: int, *, kept: bool) -> None:
        self.done.append((stage, index, kept))

    def submit(self, unit: Unit) -> Future[Any]:
        self.submitted.append(unit)
        future: Future[Any] = Future()
        if unit.stage == "merge":
            future.set_result(_merged(unit.index))
        else:
            verified = VerifyResult(
                shard=unit.index, file="", num_tensors=0, tensors={}, metadata={}, failures=(),
                bytes_read=0, seconds=0.0,
            )  # fmt: skip
            future.set_result(verified)
        return future


def _merged(shard: int) -> MergeResult:
    return MergeResult(
        shard=shard, file=f"s{shard}", file_bytes=10, data_bytes=1, bytes_read=1, tensors={},
        ledger={}, seconds=0.0,
    )  # fmt: skip


def test_a_kept_merge_must_match_the_shard_on_disk_and_takes_no_place() -> None:
    """A merge record holds only with the shard's identity on disk as recorded; a kept merge
    takes no place among the merges that run (the last round is nearer)."""
    records = {
        ("merge", 0): {"result": _merged(0).to_json(), "identity": [10, "v0"]},
        ("merge", 1): {"result": _merged(1).to_json(), "identity": [10, "changed"]},
    }
    executor = _Executor(Policy(limit=1, at_once=1), records)
    results = Scheduler(
        _job(3), executor, cast(DiskChecks, _Checks()), parts=[], direct=True, reused=(),
        run_id="r",
    ).run()  # fmt: skip
    assert results.kept == {"extract": 0, "merge": 1, "verify": 0}
    assert results.executed == {"extract": 0, "merge": 2, "verify": 3}
    merges = [(u.index, u.position) for u in executor.submitted if u.stage == "merge"]
    assert merges == [(1, 0), (2, 1)]
    assert ("merge", 0, True) in executor.done
    assert "1 merge" in results.resumed
    # under a limit of one: each merge is followed by its verify
    order = [(u.stage, u.index) for u in executor.submitted]
    assert order == [("verify", 0), ("merge", 1), ("verify", 1), ("merge", 2), ("verify", 2)]


def test_a_failed_unit_raises_only_once_no_other_unit_runs() -> None:
    """Both executors' callers release their leases when `run` raises: a sibling still
    writing would race the next run that takes them (issue 24 item 7, for either path)."""
    finished: list[int] = []

    class Failing(_Executor):
        def submit(self, unit: Unit) -> Future[Any]:
            future: Future[Any] = Future()

            def run() -> None:
                if unit.index == 0:
                    future.set_exception(RuntimeError("merge 0 failed"))
                    return
                time.sleep(0.3)
                finished.append(unit.index)
                future.set_result(_merged(unit.index))

            threading.Thread(target=run).start()
            return future

    executor = Failing(Policy(limit=2, at_once=2), {})
    scheduler = Scheduler(
        _job(2), executor, cast(DiskChecks, _Checks()), parts=[], direct=True, reused=(),
        run_id="r",
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="merge 0 failed"):
        scheduler.run()
    assert finished == [1]
