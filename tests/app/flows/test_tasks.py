"""Each task through `task.fn()`, the cache keys, and the flow's scheduler over the real tasks
with a plain thread pool: the DAG's edges without a Prefect server."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest
from prefect.logging import disable_run_logger

from tests.app.flows.conftest import journal
from tests.conftest import SAMPLE_CKPT
from zerosafe.config import ConvertOptions
from zerosafe.errors import ConversionError
from zerosafe.pipeline import parts_to_extract
from zerosafe.run.schedule import DiskChecks, Policy, Scheduler, Unit
from zerosafe.run.unit_records import fingerprint
from zerosafe.stages.output import reusable_shards
from zerosafe.stages.results import JobPlan, PublishResult
from zerosafe_app.flows.schedule import PrefectExecutor
from zerosafe_app.tasks._common import Job, WorkAreaConflictError, cache_key, context
from zerosafe_app.tasks.extract import extract
from zerosafe_app.tasks.inspect import inspect
from zerosafe_app.tasks.merge import merge
from zerosafe_app.tasks.publish import finish, publish
from zerosafe_app.tasks.verify import verify

STAGED = ConvertOptions(max_shard_size=20_000, dtype="bf16")


@pytest.fixture(autouse=True)
def _no_run_logger() -> Iterator[None]:
    with disable_run_logger():
        yield


def _plan(out: Path, options: ConvertOptions = STAGED) -> tuple[JobPlan, dict[str, Any]]:
    job = JobPlan.from_json(inspect.fn(str(SAMPLE_CKPT), str(out), options))
    task_job = Job(str(SAMPLE_CKPT), str(out), job.work_url, job.job_key, options, {})
    return job, task_job.as_dict()


def test_each_task_in_order(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job, task_job = _plan(out)
    assert job.state == "empty" and len(job.parts) == 3 and len(job.shards) == 2
    extracts = [extract.fn(task_job, p.index, p.rank, p.label) for p in job.parts]
    merges = [merge.fn(task_job, s.index, s.index + 1, 2, fingerprint="f") for s in job.shards]
    verifies = [
        verify.fn(task_job, m["shard"], m["shard"] + 1, 2, m["tensors"], fingerprint="f")
        for m in merges
    ]
    assert all(v["ok"] for v in verifies) and {v["shard"] for v in verifies} == {0, 1}
    ran = [(e["stage"], e["index"]) for e in journal(Path(job.work_url))]
    assert sorted(ran) == [("extract", i) for i in range(3)] + [("merge", 0), ("merge", 1),
                                                              ("verify", 0), ("verify", 1)]  # fmt: skip
    stats = {"mode": "staged", "mode_reason": "", "source_bytes_read": 1, "source_bytes_needed": 1,
             "intermediate_bytes_written": 0, "output_bytes_written": 0, "bytes_read": 0,
             "bytes_written": 0, "fp32_bytes": 0}  # fmt: skip
    published = PublishResult.from_json(publish.fn(task_job, extracts, merges, verifies, stats))
    assert published.files == (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    )
    assert (out / "zerosafe-complete.json").exists()
    finish.fn(task_job)
    assert not (out / ".zerosafe-work").exists()
    assert JobPlan.from_json(inspect.fn(str(SAMPLE_CKPT), str(out), STAGED)).is_done


def test_a_work_area_holding_another_jobs_plan_is_a_one_line_error(tmp_path: Path) -> None:
    """Issue 24, 12: two conversions given one `--work-dir`; the second's plan replaced the
    first's, whose tasks then met an `assert` (gone under `python -O`, naming no fix)."""
    work = str(tmp_path / "work")
    first = STAGED
    job = JobPlan.from_json(inspect.fn(str(SAMPLE_CKPT), str(tmp_path / "a"), first, work_dir=work))
    other = ConvertOptions(max_shard_size=20_000, dtype="fp32")
    inspect.fn(str(SAMPLE_CKPT), str(tmp_path / "b"), other, work_dir=work)
    task_job = Job(str(SAMPLE_CKPT), str(tmp_path / "a"), work, job.job_key, first, {})
    with pytest.raises(WorkAreaConflictError) as e:
        extract.fn(task_job.as_dict(), 0, job.parts[0].rank, job.parts[0].label)
    message = str(e.value)
    assert isinstance(e.value, ConversionError) and "\n" not in message
    assert message.startswith(f"{work}/plan: ") and job.job_key[:16] in message
    assert "another job" in message and "its own `--work-dir`" in message


def _inputs(stage: str, **changes: Any) -> dict[str, Any]:
    options = {k: v for k, v in changes.items() if k in ConvertOptions.__dataclass_fields__}
    job = {"job_key": "k", "options": ConvertOptions(**options)}
    inputs: dict[str, Any] = {"job": job, "index": 3, "fingerprint": "abc"}
    inputs.update({k: v for k, v in changes.items() if k not in options})
    return inputs


def test_cache_keys_name_the_stage_the_unit_and_what_changes_the_result() -> None:
    key = cache_key("merge")
    base = key(None, _inputs("merge"))
    assert base == key(None, _inputs("merge")) and base.startswith("zerosafe-merge-")
    assert cache_key("verify")(None, _inputs("merge")) != base
    for change in (
        {"index": 4},
        {"fingerprint": "abd"},
        {"direct": True},
        {"allow_nonfinite": True},
    ):
        assert key(None, _inputs("merge", **change)) != base, change
    for same in ({"keep_work": True}, {"memory": 2 * 10**9}):  # a re-run with these resumes
        assert key(None, _inputs("merge", **same)) == base, same


def test_verify_cache_key_holds_file_sha256_only_when_on() -> None:
    """A verify cached without the whole-file hash is redone when it is asked for; every
    other key stays as it was, so runs cached before the option existed still resume."""

    def inputs(**options: Any) -> dict[str, Any]:  # `_inputs` with options it lacks
        return _inputs("", **options)

    for stage in ("verify", "merge"):
        key, base = cache_key(stage), cache_key(stage)(None, _inputs(""))
        assert key(None, inputs(file_sha256=False)) == base
        assert (key(None, inputs(file_sha256=True)) == base) is (stage == "merge")


def test_verify_task_hashes_the_file_and_publish_records_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    options = ConvertOptions(max_shard_size=20_000, direct=True, file_sha256=True)
    job, task_job = _plan(out, options)
    merges = [merge.fn(task_job, s.index, s.index + 1, 2, fingerprint="f") for s in job.shards]
    verifies = [
        verify.fn(task_job, m["shard"], m["shard"] + 1, 2, m["tensors"], fingerprint="f")
        for m in merges
    ]
    stats = {"mode": "direct", "mode_reason": "", "source_bytes_read": 1, "source_bytes_needed": 1,
             "intermediate_bytes_written": 0, "output_bytes_written": 0, "bytes_read": 0,
             "bytes_written": 0, "fp32_bytes": 0}  # fmt: skip
    publish.fn(task_job, [], merges, verifies, stats)
    files = json.loads((out / "zerosafe-manifest.json").read_text())["files"]
    assert len(files) == len(job.shards) > 1
    for entry in files:
        assert entry["sha256"] == hashlib.sha256((out / entry["file"]).read_bytes()).hexdigest()


class _Pool:
    """A `Submit` running the tasks' functions on threads, recording what was submitted when."""

    def __init__(self, workers: int) -> None:
        self.pool = ThreadPoolExecutor(workers)
        self.lock = threading.Lock()
        self.events: list[tuple[str, str, int, bool]] = []  # (what, stage, index, refresh)
        self.fingerprints: dict[tuple[str, int], str] = {}
        self.kwargs: dict[tuple[str, int], dict[str, Any]] = {}

    def __call__(self, task: Any, *args: Any, refresh: bool = False, **kwargs: Any) -> Future[Any]:
        kwargs.pop("wait_for", None)
        stage, index = task.name, args[1]
        with self.lock:
            self.events.append(("submit", stage, index, refresh))
            self.fingerprints[(stage, index)] = kwargs.get("fingerprint", "")
            self.kwargs[(stage, index)] = dict(kwargs)

        def run() -> Any:
            result = task.fn(*args, **kwargs)
            with self.lock:
                self.events.append(("done", stage, index, refresh))
            return result

        return self.pool.submit(run)


def _schedule(
    out: Path,
    pool: _Pool,
    *,
    limit: int | None,
    options: ConvertOptions = STAGED,
    serial_merges: bool = False,
) -> tuple[JobPlan, Any]:
    job, task_job = _plan(out, options)
    plan, storage, _, _ = context(Job.from_json(task_job))
    reused = reusable_shards(storage, job.destination, plan)
    return job, _scheduler(
        job, task_job, pool, limit=limit, options=options, reused=reused,
        serial_merges=serial_merges,
    ).run()  # fmt: skip


class _Recording(PrefectExecutor):
    """The flow's executor, recording the units it was handed."""

    units: list[Unit]

    def submit(self, unit: Unit) -> Any:
        self.units.append(unit)
        return super().submit(unit)


def _scheduler(
    job: JobPlan,
    task_job: dict[str, Any],
    pool: _Pool,
    *,
    limit: int | None,
    options: ConvertOptions,
    reused: set[int],
    serial_merges: bool = False,
) -> Scheduler:
    """The engine's scheduler driving the flow's executor, on `pool` (no Prefect server)."""
    plan, storage, _, work = context(Job.from_json(task_job))
    executor = _Recording(
        job, task_job, submit=pool, options=options,
        policy=Policy(limit=limit, at_once=options.parallel_tasks, serial_merges=serial_merges),
    )  # fmt: skip
    executor.units = []
    return Scheduler(
        job, executor, DiskChecks(plan, storage, work, job.destination),
        parts=parts_to_extract(job, direct=options.direct, reused=reused),
        direct=options.direct, reused=reused, run_id=task_job["run_id"],
    )  # fmt: skip


def test_merges_wait_for_their_parts_and_verifies_follow_their_merge(tmp_path: Path) -> None:
    pool = _Pool(workers=1)
    job, done = _schedule(tmp_path / "out", pool, limit=1)
    order = [(what, stage, index) for what, stage, index, _ in pool.events]
    for shard in job.shards:
        merged_at = order.index(("submit", "merge", shard.index))
        for part in shard.parts:
            assert order.index(("done", "extract", part)) < merged_at
        # The verify is the next task submitted once the merge is done.
        after = order[order.index(("done", "merge", shard.index)) + 1 :]
        assert next(e for e in after if e[0] == "submit") == ("submit", "verify", shard.index)
    assert sorted(done.verifies) == [s.index for s in job.shards]
    assert all(v.ok for v in done.verifies.values())
    assert done.merges[0].tensors.keys() == done.verifies[0].tensors.keys()


def test_a_verify_starts_before_later_extracts_in_direct_mode_too(tmp_path: Path) -> None:
    pool = _Pool(workers=1)
    options = ConvertOptions(max_shard_size=10_000, direct=True)
    job, _ = _schedule(tmp_path / "out", pool, limit=1, options=options)
    submitted = [(stage, index) for what, stage, index, _ in pool.events if what == "submit"]
    assert len(job.shards) > 2 and not any(stage == "extract" for stage, _ in submitted)
    assert submitted[:3] == [("merge", 0), ("verify", 0), ("merge", 1)]


def _most_in_flight(events: list[tuple[str, str, int, bool]], stage: str | None) -> int:
    running = most = 0
    for what, event_stage, _, _ in events:
        if stage is None or event_stage == stage:
            running += 1 if what == "submit" else -1
            most = max(most, running)
    return most


@pytest.mark.parametrize("serial", [False, True])
def test_serial_merges_run_one_merge_at_a_time_with_a_verify_beside_it(
    tmp_path: Path, serial: bool
) -> None:
    pool = _Pool(workers=2)
    options = ConvertOptions(max_shard_size=10_000, direct=True)
    job, done = _schedule(tmp_path / "out", pool, limit=2, options=options, serial_merges=serial)
    assert len(job.shards) > 2 and all(v.ok for v in done.verifies.values())
    assert sorted(done.verifies) == [s.index for s in job.shards]
    assert _most_in_flight(pool.events, None) == 2
    # Without the rule the first two tasks are two merges; with it, the second task
    # submitted is the first shard's verify, beside the second merge.
    submitted = [(stage, index) for what, stage, index, _ in pool.events if what == "submit"]
    assert (submitted[:2] == [("merge", 0), ("merge", 1)]) is not serial
    assert (_most_in_flight(pool.events, "merge") == 1) is serial


@pytest.mark.parametrize("direct", [False, True])
def test_merges_learn_their_place_in_the_order_they_were_submitted(
    tmp_path: Path, direct: bool
) -> None:
    """The last round's merges copy in streams (`merge_streams`); in staged mode merges become
    ready as their parts are extracted, so their place is the submission order, not the
    shard's index, and a shard a repair keeps takes none."""
    options = ConvertOptions(max_shard_size=10_000, dtype="bf16", direct=direct)
    job, task_job = _plan(tmp_path / "out", options)
    pool = _Pool(workers=2)
    # A shard kept by a repair (read directly, so its merge, unneeded, still has a source).
    reused = {1} if direct else set()
    scheduler = _scheduler(job, task_job, pool, limit=None, options=options, reused=reused)
    done = scheduler.run()
    assert len(job.shards) > 2 and all(v.ok for v in done.verifies.values())
    executor = cast(_Recording, scheduler.executor)
    merges = [u for u in executor.units if u.stage == "merge"]
    places = {u.index: u.position for u in merges}
    assert all(places[i] is None for i in reused)
    to_merge = len(job.shards) - len(reused)
    assert [places[u.index] for u in merges if u.index not in reused] == list(range(to_merge))
    # the task is told the streams the scheduler chose from that place
    assert all(pool.kwargs[("merge", u.index)]["streams"] == u.streams for u in merges)


def test_what_is_on_disk_decides_which_caches_are_refreshed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = _Pool(workers=2)
    job, done = _schedule(
        out, first, limit=None, options=ConvertOptions(**{**STAGED.as_dict(), "keep_work": True})
    )
    assert all(
        refresh
        for what, stage, _, refresh in first.events
        if what == "submit" and stage != "verify"
    )
    again = _Pool(workers=2)
    _schedule(
        out, again, limit=None, options=ConvertOptions(**{**STAGED.as_dict(), "keep_work": True})
    )
    assert not any(refresh for *_, refresh in again.events), "outputs on disk, caches kept"
    # A merge's cache key names the content of the intermediates it reads.
    shard = job.shards[0]
    want = fingerprint([done.extracts[p].content_sha256 for p in shard.parts])
    assert first.fingerprints[("merge", 0)] == want == again.fingerprints[("merge", 0)]
    (Path(job.work_url) / "intermediate" / "rank00001-part0000.safetensors").unlink()
    third = _Pool(workers=2)
    _schedule(
        out, third, limit=None, options=ConvertOptions(**{**STAGED.as_dict(), "keep_work": True})
    )
    refreshed = {
        (stage, index)
        for what, stage, index, refresh in third.events
        if what == "submit" and refresh
    }
    assert refreshed == {("extract", 1)}
    # Re-extracted with the same content: every merge keeps its cache key. (Verify keys name
    # the shard's mtime, which this pool's uncached merges changed.)
    assert {k: v for k, v in third.fingerprints.items() if k[0] == "merge"} == {
        k: v for k, v in first.fingerprints.items() if k[0] == "merge"
    }
