"""`prefect deployment run convert/80b` against real servers (SQLite and PostgreSQL), a real
process worker and the loopback S3 server; the server's scheduler creating `watch` runs;
`watch` converting new tags exactly once; hundreds of tasks on one server."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from datetime import time as dt_time
from pathlib import Path
from typing import Any

import pytest

from bench.forge import forge_checkpoint, transformer_shapes
from tests.app.deploy.conftest import BIN, Stack, params_json
from tests.conftest import REPO, SAMPLE_CKPT
from tests.helpers import load_output, same_bytes
from tests.io.s3.support import MotoServer, assert_same_output, download_folder, upload_folder
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint

pytestmark = pytest.mark.slow


def _run_80b(stack: Stack, moto: MotoServer, source: str, out: str, work: str) -> Any:
    return stack.prefect(
        "deployment", "run", "convert/80b",
        "--params", params_json(
            source=source, destination=out, work_dir=work, runner="threads", dtype="fp32",
            storage_options={"endpoint_url": moto.url},
        ),
        "--watch", "--watch-timeout", "900",
    )  # fmt: skip


@pytest.mark.parametrize("stack_name", ["sqlite_stack", "postgres_stack"])
def test_deployment_run_convert_80b_from_s3_is_bit_exact(
    request: pytest.FixtureRequest, stack_name: str, moto: MotoServer, bucket: str, sample_s3: str,
    local_reference: Path, tmp_path: Path,
) -> None:  # fmt: skip
    stack: Stack = request.getfixturevalue(stack_name)
    out = f"s3://{bucket}/hf"
    started = time.monotonic()
    _run_80b(stack, moto, sample_s3, out, f"s3://{bucket}/work")
    print(f"\n{stack_name}: convert/80b from S3 took {time.monotonic() - started:.1f} s end to end")
    got = download_folder(moto.url, out, tmp_path / "got")
    assert_same_output(got, local_reference)
    with stack.client() as client:
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["80b"]))
        )
        assert runs and runs[0].state.is_completed()
        # the job file's values arrived, overridden by the parameters given
        assert (
            runs[0].parameters["conf"] == "conf/80b.yaml" and runs[0].parameters["dtype"] == "fp32"
        )


def _scheduled_runs(stack: Stack, deployment: str | None = None) -> list[Any]:
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with stack.client() as client:
        return list(
            client.read_flow_runs(
                deployment_filter=(
                    DeploymentFilter(name=DeploymentFilterName(any_=[deployment]))
                    if deployment
                    else None
                ),
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(
                        type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])
                    )
                ),
            )
        )


def test_deploy_arms_no_schedule_and_resuming_turns_watch_on(sqlite_stack: Stack) -> None:
    stack = sqlite_stack
    # deploy.sh says what is an example and how to turn the schedule on
    out = stack.deploy_output
    assert "convert/80b" in out and "needs S3" in out and "Dask" in out
    assert "PAUSED" in out and "prefect deployment schedule resume watch/watch" in out
    with stack.client() as client:
        deployments = client.read_deployments()
        schedules = [(d.name, s) for d in deployments for s in d.schedules]
    assert ("watch", False) in [(name, s.active) for name, s in schedules]
    assert not [name for name, s in schedules if s.active], schedules
    # the scheduler loops every 2 s here: give it several chances to create runs
    time.sleep(10)
    assert not _scheduled_runs(stack), "a scheduled run exists right after deploy.sh"

    # turned on as docs/deployment.md says, the server schedules watch runs on its cron
    listed = stack.prefect("deployment", "schedule", "ls", "watch/watch").stdout
    (schedule_id,) = re.findall(
        r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", listed
    )
    stack.prefect("deployment", "schedule", "resume", "watch/watch", schedule_id)
    deadline = time.monotonic() + 120
    while not (scheduled := _scheduled_runs(stack, "watch")):
        assert time.monotonic() < deadline, "the server created no scheduled watch run in 120 s"
        time.sleep(2)
    times = sorted(r.expected_start_time for r in scheduled)
    assert all(t.minute % 15 == 0 and t.second == 0 for t in times), times  # cron */15
    print(f"\nresumed: the scheduler created {len(scheduled)} watch runs, first at {times[0]}")
    # and paused again it stops (its queued runs go with it), so the worker runs only the
    # tests' own watch runs
    stack.prefect("deployment", "schedule", "pause", "watch/watch", schedule_id)
    deadline = time.monotonic() + 60
    while _scheduled_runs(stack, "watch"):
        assert time.monotonic() < deadline, "pausing left scheduled watch runs"
        time.sleep(2)


def _created_run_id(stdout: str) -> str:
    (run_id,) = re.findall(r"UUID: ([0-9a-f-]{36})", stdout)
    return run_id


def _job_runs(stack: Stack, parent_id: str) -> tuple[Any, Any]:
    """The parent `convert` run and its `convert-job` subflow run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with stack.client() as client:
        parent = client.read_flow_run(parent_id)
        (child,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id])
            )
        )
    return parent, child


def _artifacts(stack: Stack, *run_ids: Any) -> list[Any]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with stack.client() as client:
        return list(
            client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=list(run_ids))
                )
            )
        )


def test_failed_run_says_why_in_state_message_and_watch_output(
    sqlite_stack: Stack, tmp_path: Path
) -> None:
    from zerosafe_app.flows.convert import job_slug

    stack = sqlite_stack
    out = tmp_path / "out"
    env = {**stack.env, "COLUMNS": "1000"}  # one log record, one line of the watch output
    proc = subprocess.run(
        [str(BIN / "prefect"), "deployment", "run", "convert/default",
         "--param", "source=/nonexistent", "--param", f"destination={out}",
         "--watch", "--watch-timeout", "600"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=700,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    one_line = "CheckpointFormatError: /nonexistent: no such checkpoint folder"
    print(f"\n--watch printed:\n{proc.stdout[-2500:]}")
    watched = [line for line in proc.stdout.splitlines() if one_line in line]
    assert watched, proc.stdout[-3000:]
    assert any("read on the machine that runs the flow" in line for line in watched), watched
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]

    parent, child = _job_runs(stack, _created_run_id(proc.stdout))
    for run in (parent, child):
        assert run.state.is_failed(), run.state
        assert run.state.message.startswith(one_line), run.state.message
        assert "\n" not in run.state.message
    assert str(child.id) in parent.state.message  # the parent points at the subflow
    assert set(parent.tags) <= set(child.tags) and "zerosafe" in child.tags
    slug = job_slug(str(out))
    artifacts = {a.key: a for a in _artifacts(stack, parent.id, child.id)}
    failure = artifacts[f"zerosafe-{slug}-failure"]
    assert failure.flow_run_id == child.id and one_line in failure.data
    assert artifacts[f"zerosafe-{slug}-run"].flow_run_id == parent.id
    assert str(child.id) in artifacts[f"zerosafe-{slug}-run"].data


def test_runs_and_artifacts_are_named_and_keyed_per_job(
    sqlite_stack: Stack, tmp_path: Path
) -> None:
    from prefect.client.schemas.filters import (
        LogFilter,
        LogFilterFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    from zerosafe_app.flows.convert import job_slug

    stack = sqlite_stack
    outs = [tmp_path / "hf" / "a", tmp_path / "hf" / "b"]
    children = []
    for out in outs:
        proc = stack.prefect(
            "deployment", "run", "convert/default",
            "--params", params_json(source=str(SAMPLE_CKPT), destination=str(out), max_shard_size="20KB", keep_work=True, mode="staged"),
            "--watch", "--watch-timeout", "600",
        )  # fmt: skip
        parent, child = _job_runs(stack, _created_run_id(proc.stdout))
        assert parent.name == f"convert examples/zero3-bf16-ws3 -> hf/{out.name}", parent.name
        assert child.name == f"convert-job examples/zero3-bf16-ws3 -> hf/{out.name}", child.name
        assert parent.state.is_completed() and str(child.id) in parent.state.message
        assert set(parent.tags) <= set(child.tags) and "zerosafe" in child.tags
        slug = job_slug(str(out))
        keyed = {a.key: a for a in _artifacts(stack, parent.id, child.id) if a.key}
        assert keyed[f"zerosafe-{slug}"].flow_run_id == child.id
        assert "tasks executed" in keyed[f"zerosafe-{slug}"].data
        assert keyed[f"zerosafe-{slug}-progress"].type == "progress"
        assert float(keyed[f"zerosafe-{slug}-progress"].data) == 100.0
        assert keyed[f"zerosafe-{slug}-run"].flow_run_id == parent.id
        children.append(child)
    assert job_slug(str(outs[0])) != job_slug(str(outs[1]))

    # one log line per task with bytes, seconds and throughput; merge waits for its extracts
    child = children[-1]
    with stack.client() as client:
        tasks = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[child.id]))
        )
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[child.id]))
        )
    by_id = {t.id: t for t in tasks}
    lines = [entry.message for entry in logs]
    for t in tasks:
        if t.name.startswith(("extract", "merge", "verify")):
            (line,) = [m for m in lines if m.startswith(f"{t.name}: read ")]
            assert re.search(r" in \d+\.\d\d s \(.*/s\); memory \+", line), line
    merges = [t for t in tasks if t.name.startswith("merge")]
    for m in merges:
        upstream = [by_id[i.id].name for i in m.task_inputs.get("wait_for", []) if i.id in by_id]
        assert upstream and all(u.startswith("extract") for u in upstream), (m.name, upstream)
    print("\n" + "\n".join(m for m in lines if m.startswith("merge shard 1/")))


def test_verify_only_rerun_reports_its_own_peak_memory(sqlite_stack: Stack, tmp_path: Path) -> None:
    stack = sqlite_stack
    out = tmp_path / "out"

    def run() -> dict[str, Any]:
        stack.prefect(
            "deployment", "run", "convert/default",
            "--params", params_json(source=str(SAMPLE_CKPT), destination=str(out), max_shard_size="20KB", keep_work=True, mode="staged"),
            "--watch", "--watch-timeout", "600",
        )  # fmt: skip
        stats: dict[str, Any] = json.loads((out / "zerosafe-manifest.json").read_text())["stats"]
        return stats

    first = run()
    # the output loses its marker and one shard is touched: only verifies run again (every
    # shard's: a verify result is never reused from an earlier run)
    (out / "zerosafe-complete.json").unlink()
    shard = sorted(out.glob("model-*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    second = run()
    print(
        f"\nfirst run: growth by stage {first['rss_growth_bytes_by_stage']} over a "
        f"{first['rss_baseline_bytes']} B baseline; verify-only rerun: "
        f"{second['rss_growth_bytes_by_stage']} over {second['rss_baseline_bytes']} B"
    )
    assert set(first["rss_growth_bytes_by_stage"]) == {"extract", "merge", "verify"}
    assert second["tasks_executed"] == {
        "extract": 0,
        "merge": 0,
        "verify": len(list(out.glob("model-*.safetensors"))),
    }
    assert set(second["rss_growth_bytes_by_stage"]) == {"verify"}
    # A running peak of the whole process is at least its baseline (imports alone are over
    # 100 MB, torch included); each stage's own growth on the sample is a small fraction.
    for stats in (first, second):
        baseline = stats["rss_baseline_bytes"]
        assert baseline > 100e6
        assert all(0 <= v < baseline / 2 for v in stats["rss_growth_bytes_by_stage"].values())


def _log_records(text: str, start: dt_time, end: dt_time) -> list[str]:
    """The server's log records (a timestamped line and what follows it) logged in [start, end]."""
    records: list[tuple[dt_time, list[str]]] = []
    for line in text.splitlines():
        match = re.match(r"^(\d\d:\d\d:\d\d\.\d+) \|", line)
        if match:
            records.append((dt_time.fromisoformat(match.group(1)), [line]))
        elif records:
            records[-1][1].append(line)
    return ["\n".join(lines) for when, lines in records if start <= when <= end]


def _dest(url: str) -> str:
    """The tag watch puts on the conversion runs it starts for destination `url`."""
    from zerosafe_app.flows.watch import _dest_tag

    return _dest_tag(url)


def _wait_runs(stack: Stack, tag: str, count: int, timeout: float = 600) -> list[Any]:
    """The deployment runs tagged `tag` (their `convert-job` subflows carry the tag too)."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterTags,
    )

    deadline = time.monotonic() + timeout
    while True:
        with stack.client() as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    tags=FlowRunFilterTags(all_=[tag]),
                    deployment_id=FlowRunFilterDeploymentId(is_null_=False),
                )
            )
        final = [r for r in runs if r.state and r.state.is_final()]
        if len(final) >= count and len(final) == len(runs):
            return runs
        if time.monotonic() > deadline:
            raise AssertionError(f"runs tagged {tag}: {[(r.name, r.state_name) for r in runs]}")
        time.sleep(2)


def _watch(
    stack: Stack, moto: MotoServer, root: str, dest: str, *, wait: bool = True, **extra: Any
) -> str:
    params = {
        "root": root, "destination_root": dest, "deployment": "convert/default", "conf": None,
        "max_concurrent": 2, "storage_options": {"endpoint_url": moto.url},
        "parameters": {"dtype": "fp32", "max_shard_size": "20KB", "keep_work": True}, **extra,
    }  # fmt: skip
    args = [
        "deployment",
        "run",
        "watch/watch",
        "--params",
        json.dumps(params),
        "--start-in",
        "1 second",
    ]
    if wait:
        args += ["--watch", "--watch-timeout", "600"]
    proc = stack.prefect(*args)
    return proc.stdout


def test_watch_converts_each_new_tag_once_and_resumes_partial_ones(
    sqlite_stack: Stack, moto: MotoServer, bucket: str, tmp_path: Path
) -> None:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    stack = sqlite_stack
    root, dest = f"s3://{bucket}/run1/checkpoints", f"s3://{bucket}/run1/hf"
    # training wrote tag global_step2 (the sample) and named it in `latest`
    upload_folder(moto.url, SAMPLE_CKPT, bucket, "run1/checkpoints")

    # a scheduled watch run converts it
    _watch(stack, moto, root, dest)
    (convert_run,) = _wait_runs(stack, _dest(f"{dest}/global_step2"), 1)
    assert convert_run.state.is_completed(), convert_run.state
    got = download_folder(moto.url, f"{dest}/global_step2", tmp_path / "step2")
    ref = tmp_path / "ref"
    convert_checkpoint(str(SAMPLE_CKPT), str(ref), ConvertOptions(max_shard_size=20_000))
    ours, _ = load_output(got)
    theirs, _ = load_output(ref)
    assert set(ours) == set(theirs) and all(same_bytes(ours[k], theirs[k]) for k in ours)

    # training is writing global_step3: one rank file present, `latest` not yet updated
    partial_tag = tmp_path / "writing" / "global_step3"
    partial_tag.mkdir(parents=True)
    for f in (SAMPLE_CKPT / "global_step2").glob("*rank_0*"):
        shutil.copy(f, partial_tag / f.name)
    upload_folder(moto.url, partial_tag.parent, bucket, "run1/checkpoints")
    # two watch runs at once: nothing new to convert, nothing converted twice
    _watch(stack, moto, root, dest, wait=False)
    _watch(stack, moto, root, dest)
    time.sleep(5)
    runs = _wait_runs(stack, _dest(f"{dest}/global_step2"), 1)
    assert len(runs) == 1, [(r.name, r.state_name) for r in runs]
    with stack.client() as client:
        assert not client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[_dest(f"{dest}/global_step3")])
            )
        )

    # global_step3 finished and `latest` names it; its conversion was started and killed
    # before (work area, no marker): watch starts it again and it resumes
    for f in (SAMPLE_CKPT / "global_step2").iterdir():
        shutil.copy(f, partial_tag / f.name)
    (partial_tag.parent / "latest").write_text("global_step3")
    upload_folder(moto.url, partial_tag.parent, bucket, "run1/checkpoints")
    # two watch runs started together: the idempotency key lets only one conversion start
    _watch(stack, moto, root, dest, wait=False)
    _watch(stack, moto, root, dest)
    time.sleep(5)
    (step3,) = _wait_runs(stack, _dest(f"{dest}/global_step3"), 1)  # one conversion, not two
    assert step3.state.is_completed(), step3.state
    assert len(_wait_runs(stack, _dest(f"{dest}/global_step2"), 1)) == 1  # not converted again


def test_resumes_a_partially_converted_tag(
    sqlite_stack: Stack, moto: MotoServer, bucket: str, tmp_path: Path
) -> None:
    import s3fs

    stack = sqlite_stack
    root, dest = f"s3://{bucket}/run2/checkpoints", f"s3://{bucket}/run2/hf"
    upload_folder(moto.url, SAMPLE_CKPT, bucket, "run2/checkpoints")
    _watch(stack, moto, root, dest)
    _wait_runs(stack, _dest(f"{dest}/global_step2"), 1)
    # undo the end of that conversion: no marker, no index, one shard gone; work area kept
    fs = s3fs.S3FileSystem(endpoint_url=moto.url, use_listings_cache=False)
    out = f"{dest}/global_step2"
    for name in (
        "zerosafe-complete.json",
        "model.safetensors.index.json",
        "model-00002-of-00005.safetensors",
    ):
        fs.rm(f"{out}/{name}")
    (work,) = [p for p in fs.ls(f"{out}/.zerosafe-work/") if not p.endswith("/")]
    before = set(fs.ls(f"{work}/journal"))
    _watch(stack, moto, root, dest)
    runs = _wait_runs(stack, _dest(f"{dest}/global_step2"), 2)
    assert len(runs) == 2 and all(r.state.is_completed() for r in runs)
    new = [json.loads(fs.cat(p)) for p in set(fs.ls(f"{work}/journal")) - before]
    ran = sorted((e["stage"], e["index"]) for e in new)
    print(f"\nresumed conversion executed {ran}")
    # Only the lost shard is merged again, and no extract runs; every shard is verified
    # again, as a verify result never outlives its run (a kept shard may have been damaged).
    assert ("merge", 1) in ran and ("publish", 0) in ran
    assert {e for e in ran if e[0] != "verify"} == {("merge", 1), ("publish", 0)}
    assert {i for stage, i in ran if stage == "verify"} == set(range(5))
    assert fs.exists(f"{out}/zerosafe-complete.json")


_LOCK_ERROR = re.compile(r"database is locked|deadlock detected|LockNotAvailable")


def _lock_kind(record: str) -> str:
    """What met the lock, in a few words: the logger and the SQL statement's head, e.g.
    `prefect.server.services... : UPDATE work_pool`."""
    source = re.search(r"\| \w+ +\| ([\w.\-]+) - ", record)
    sql = re.search(r"\[SQL: ((?:INSERT INTO|UPDATE|DELETE FROM) \w+|SELECT)", record)
    return f"{source.group(1) if source else '?'}: {sql.group(1) if sql else '?'}"


def _all_task_runs(stack: Stack, flow_run_id: Any, want: int, timeout: float = 120) -> list[Any]:
    """The flow run's task runs, once there are `want` of them and all are final (their
    states reach the database through events, shortly after the run ends) or `timeout`."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    with stack.client() as client:
        while True:
            tasks: list[Any] = []
            while True:
                page = client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                    limit=200,
                    offset=len(tasks),
                )
                tasks += page
                if len(page) < 200:
                    break
            settled = all(t.state is not None and t.state.is_final() for t in tasks)
            if (len(tasks) >= want and settled) or time.monotonic() > deadline:
                return tasks
            time.sleep(2)


@pytest.mark.parametrize("stack_name", ["sqlite_stack", "postgres_stack"])
def test_hundreds_of_tasks_on_one_server(
    request: pytest.FixtureRequest,
    stack_name: str,
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    """About 360 shards, so 700+ task runs, on one server. What zerosafe promises on either
    database: every task run reaches a final state, nothing is converted twice, and the output
    verifies and equals the engine's bit for bit.

    Prefect's own background services (worker heartbeats, work-queue poll stamps, worker
    health, event flushes) also write to the database; on SQLite some of those writes meet
    its single-writer lock, and Prefect logs them and writes again later. They are counted
    and printed as figures, not asserted on: the promise above is what a SQLite user relies
    on. PostgreSQL is the strict stack: no lock error at all."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    from zerosafe.verify.output import verify_output

    stack: Stack = request.getfixturevalue(stack_name)
    server_log = stack.home.parent / "server.log"
    ckpt = tmp_path / "ckpt"
    shapes = transformer_shapes(vocab=97, width=24, layers=30, ffn=40, kv_width=24)
    forge_checkpoint(ckpt, shapes=shapes, stage=3, world_size=2, dtype="bf16", tied=False)
    out = tmp_path / "out"
    started = time.monotonic()
    window = (datetime.now() - timedelta(seconds=1)).time()
    stack.prefect(
        "deployment", "run", "convert/default",
        "--params", params_json(source=str(ckpt), destination=str(out), max_shard_size="1KB",
                                dtype="bf16", mode="direct", keep_work=True),
        "--watch", "--watch-timeout", "1200",
    )  # fmt: skip
    seconds = time.monotonic() - started
    ours, manifest = load_output(out)
    shards = len(manifest["files"])
    with stack.client() as client:
        (job_run,) = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["convert-job"])),
            sort=FlowRunSort.START_TIME_DESC,
            limit=1,
        )
    # inspect, a merge and a verify per shard (direct mode: no extract), publish
    tasks = _all_task_runs(stack, job_run.id, 2 * shards + 2)
    window_end = (datetime.now() + timedelta(seconds=1)).time()
    states = Counter(t.state_name for t in tasks)
    during = _log_records(server_log.read_text(errors="replace"), window, window_end)
    locked = Counter(_lock_kind(r) for r in during if _LOCK_ERROR.search(r))
    figures = {
        "database": stack_name.removesuffix("_stack"), "shards": shards, "task_runs": len(tasks),
        "seconds": round(seconds), "task_runs_per_second": round(len(tasks) / seconds, 1),
        "states": dict(states), "prefect_lock_errors": sum(locked.values()),
        "prefect_lock_errors_by_kind": dict(locked),
    }  # fmt: skip
    print(f"\n{stack_name}: {json.dumps(figures)}")
    record_property("figures", figures)

    # 1. Every task run reached a final state, and the run's were all successes.
    assert shards >= 250
    assert len(tasks) >= 2 * shards + 2
    assert all(t.state is not None and t.state.is_final() for t in tasks), states
    assert set(states) <= {"Completed", "Cached"}, states
    # 2. Nothing converted twice: one task run per unit, each executed once (the journal
    #    holds an entry per execution), by one run of the job.
    names = Counter(t.name for t in tasks)
    assert [n for n, k in names.items() if k > 1] == []
    entries = [json.loads(p.read_text()) for p in out.glob(".zerosafe-work/*/journal/*.json")]
    executed = Counter((e["stage"], e["index"]) for e in entries)
    assert sorted(executed) == sorted(
        [("merge", i) for i in range(shards)]
        + [("verify", i) for i in range(shards)]
        + [("publish", 0)]
    )
    assert set(executed.values()) == {1} and len({e["run_id"] for e in entries}) == 1
    assert manifest["stats"]["tasks_executed"] == {"extract": 0, "merge": shards, "verify": shards}
    # 3. The output verifies, and equals the engine's bit for bit.
    report = verify_output(str(out))
    assert report["ok"], report["failures"][:5]
    ref = tmp_path / "ref"
    convert_checkpoint(
        str(ckpt), str(ref), ConvertOptions(dtype="bf16", max_shard_size=1000, direct=True)
    )
    theirs, _ = load_output(ref)
    assert set(ours) == set(theirs) and all(same_bytes(ours[k], theirs[k]) for k in ours)
    if stack_name == "postgres_stack":
        assert not locked, [r for r in during if _LOCK_ERROR.search(r)][0][-3000:]


def test_deployment_run_pt2st(sqlite_stack: Stack, tmp_path: Path) -> None:
    import torch

    from zerosafe import load_pt_like

    src = tmp_path / "train.pt"
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7))
    torch.save({"model": model.state_dict(), "step": 12, "lr": [0.1, 0.01]}, src)
    out = tmp_path / "train.safetensors"
    sqlite_stack.prefect(
        "deployment", "run", "pt2st/default", "--params", params_json(source=str(src), destination=str(out)),
        "--watch", "--watch-timeout", "600",
    )  # fmt: skip
    back = load_pt_like(str(out))
    want = torch.load(src, weights_only=True)
    assert back["step"] == 12 and back["lr"] == [0.1, 0.01]
    assert all(torch.equal(back["model"][k], v) for k, v in want["model"].items())
