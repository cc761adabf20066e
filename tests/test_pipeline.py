"""The job lifecycle (`zerosafe.pipeline`): its typed results, the merge order on plain ints,
each step on the shipped sample, and the sequential driver's leases and cleanup."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SAMPLE_CKPT
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import VerificationError
from zerosafe.formats.crc import IntegrityReport
from zerosafe.io.lease import LeaseHeldError
from zerosafe.io.storage import Storage
from zerosafe.pipeline import (
    MergeReadiness,
    WorkLayout,
    extract_unit,
    finish_job,
    hold_work,
    intermediate_is_present,
    merge_unit,
    parts_to_extract,
    plan_job,
    plan_job_and_load,
    publish_job,
    run_stats,
    summarize,
    verify_unit,
)
from zerosafe.stages.results import (
    ExtractResult,
    JobPlan,
    MergeResult,
    PartWork,
    PublishResult,
    RunStats,
    RunSummary,
    ShardWork,
    VerifyResult,
)

STAGED = ConvertOptions(max_shard_size=20_000, dtype="bf16")
"""Several shards, every stage runs."""


def _job(shard_parts: list[tuple[int, ...]], num_parts: int) -> JobPlan:
    return JobPlan(
        state="empty", job_key="k" * 64, destination="/out", work_url="/out/.zerosafe-work/k",
        parts=tuple(PartWork(index=i, rank=i, label="0", size_bytes=10 * (i + 1)) for i in range(num_parts)),
        shards=tuple(
            ShardWork(index=i, file_name=f"s{i}", data_bytes=5, source_bytes=7, parts=parts)
            for i, parts in enumerate(shard_parts)
        ),
    )  # fmt: skip


# -- on plain values -----------------------------------------------------------------------------


def test_a_shard_is_ready_once_every_part_it_reads_is_extracted() -> None:
    job = _job([(0, 1), (1,), (), (1, 2)], num_parts=3)
    ready = MergeReadiness(job.shards, direct=False)
    assert ready.ready() == [2]
    assert ready.part_done(1) == [1]
    assert ready.part_done(0) == [0]
    assert ready.waiting == [3]
    assert ready.part_done(0) == []  # a part reported twice hands out nothing again
    assert ready.part_done(2) == [3] and ready.waiting == []


def test_direct_mode_and_reused_shards_wait_for_nothing() -> None:
    job = _job([(0, 1), (1,), (2,)], num_parts=3)
    assert MergeReadiness(job.shards, direct=True).ready() == [0, 1, 2]
    reused = MergeReadiness(job.shards, direct=False, reused={0, 2})
    assert reused.ready() == [0, 2] and reused.part_done(1) == [1]


def test_parts_to_extract_skips_what_only_kept_shards_read() -> None:
    job = _job([(0, 1), (1,), (2,)], num_parts=3)
    assert [p.index for p in parts_to_extract(job, direct=False)] == [0, 1, 2]
    assert [p.index for p in parts_to_extract(job, direct=False, reused={0, 2})] == [1]
    assert parts_to_extract(job, direct=True) == []


@pytest.mark.parametrize(
    "result",
    [
        _job([(0,), ()], num_parts=1),
        ExtractResult(
            part=1,
            rank=0,
            file="/w/a",
            file_bytes=9,
            bytes_read=8,
            content_sha256="c",
            ledger={"u#r": [[0, 8, 7]]},
            seconds=0.1,
        ),
        MergeResult(
            shard=0,
            file="m",
            file_bytes=9,
            data_bytes=4,
            bytes_read=4,
            tensors={"t": {"dtype": "F32"}},
            ledger={},
            seconds=0.2,
        ),
        MergeResult(
            shard=0,
            file="m",
            file_bytes=9,
            data_bytes=4,
            bytes_read=0,
            tensors={},
            ledger={},
            seconds=0.0,
            reused=True,
        ),
        VerifyResult(
            shard=2,
            file="/o/m",
            num_tensors=1,
            tensors={},
            metadata={"format": "pt"},
            failures=({"file": "m", "tensor": "t", "check": "c", "detail": "d"},),
            bytes_read=4,
            seconds=0.1,
        ),
        PublishResult(
            files=("m",),
            num_tensors=1,
            integrity=IntegrityReport(records_checked=3, records_skipped=(), records_failed=()),
            stats=RunStats(
                mode="direct",
                mode_reason="",
                source_bytes_read=1,
                source_bytes_needed=1,
                intermediate_bytes_written=0,
                output_bytes_written=2,
                bytes_read=3,
                bytes_written=2,
                fp32_bytes=4,
                source_read_ratio=1.0,
            ),
        ),
    ],
    ids=["job", "extract", "merge", "merge-reused", "verify", "publish"],
)
def test_results_survive_the_task_edge(result: object) -> None:
    """What a task returns is JSON (cached by Prefect), and reads back as the same value."""
    data = json.loads(json.dumps(result.to_json()))  # type: ignore[attr-defined]
    assert type(result).from_json(data) == result  # type: ignore[attr-defined]


def test_result_json_keeps_the_keys_cached_results_have() -> None:
    """Results cached before the typed contracts still load (same keys)."""
    old_merge = {"shard": 0, "file": "m", "file_bytes": 9, "data_bytes": 4, "bytes_read": 4,
                 "tensors": {}, "ledger": {}, "seconds": 0.1}  # fmt: skip
    assert MergeResult.from_json(old_merge).to_json() == old_merge
    old_verify = {"file": "f", "ok": True, "num_tensors": 0, "tensors": {}, "metadata": {},
                  "failures": [], "bytes_read": 0, "shard": 0, "seconds": 0.0}  # fmt: skip
    assert VerifyResult.from_json(old_verify).to_json() == old_verify


def test_an_already_complete_summary_is_three_keys() -> None:
    summary = RunSummary.already_complete("/out", "k")
    assert summary.to_json() == {"status": "already-complete", "output": "/out", "job_key": "k"}
    assert (
        RunSummary.from_json(summary.to_json()) == summary and summary.status == "already-complete"
    )


# -- each step on the sample -----------------------------------------------------------------------


def test_the_lifecycle_step_by_step(tmp_path: Path) -> None:
    storage, out = Storage(), str(tmp_path / "out")
    job, plan = plan_job_and_load(storage, str(SAMPLE_CKPT), out, STAGED)
    assert plan is not None and job.state == "empty" and len(job.shards) > 1
    assert [s.parts for s in job.shards] == [tuple(p) for p in plan.shard_parts()]
    assert job.metadata_bytes_read > 0 and job.source_bytes_needed > job.fp32_bytes
    work = WorkLayout(job.work_url)
    with hold_work(storage, job):
        extracts = [extract_unit(plan, p.index, storage, work, STAGED) for p in job.parts]
        merges = [merge_unit(plan, s.index, storage, out, work, STAGED) for s in job.shards]
        verifies = [
            verify_unit(plan, m.shard, storage, out, STAGED, expected=m.tensors) for m in merges
        ]
        assert (
            all(v.ok for v in verifies)
            and not (tmp_path / "out" / "zerosafe-complete.json").exists()
        )
        stats = run_stats(
            job, STAGED, extracts=extracts, merges=merges, verifies=verifies, seconds=1.0,
            tasks_executed={"extract": 3}, peak_rss_bytes=1,
        )  # fmt: skip
        published = publish_job(
            plan, storage, out, work, STAGED,
            extracts=extracts, merges=merges, verifies=verifies, stats=stats,
        )  # fmt: skip
        finish_job(
            storage, destination=out, job_key=job.job_key, work_url=job.work_url, keep_work=False
        )
    assert published.files == tuple(s.file_name for s in job.shards)
    assert published.stats.source_bytes_read >= stats.source_bytes_read
    manifest = json.loads((tmp_path / "out" / "zerosafe-manifest.json").read_text())
    assert manifest["stats"]["tasks_executed"] == {"extract": 3}
    assert not (tmp_path / "out" / ".zerosafe-work").exists()
    summary = summarize(job, published, verifies, seconds=2.0)
    assert summary.checks_passed == sum(v.num_tensors for v in verifies)
    assert plan_job(storage, str(SAMPLE_CKPT), out, STAGED).state == "done"


def test_a_torn_intermediate_sidecar_reads_as_missing(tmp_path: Path) -> None:
    """The sidecar (`IntermediateSums`) vouches for an intermediate; a torn one sends the
    part back to extract instead of stopping the run on a JSON error."""
    storage, out = Storage(), str(tmp_path / "out")
    job, plan = plan_job_and_load(storage, str(SAMPLE_CKPT), out, STAGED)
    assert plan is not None
    work = WorkLayout(job.work_url)
    with hold_work(storage, job):
        done = extract_unit(plan, 0, storage, work, STAGED)
    assert intermediate_is_present(plan, storage, work, 0, done.content_sha256)
    assert not intermediate_is_present(plan, storage, work, 0, "another")
    (sidecar,) = (tmp_path / "out").rglob(
        plan.parts[0].file_name.removesuffix(".safetensors") + ".json"
    )
    assert list(json.loads(sidecar.read_text())) == [
        "job_key", "file", "file_bytes", "content_sha256", "crc32",
    ]  # fmt: skip
    sidecar.write_text('{"job_key": ')
    assert not intermediate_is_present(plan, storage, work, 0)


def test_a_failed_verify_publishes_nothing_and_discards_the_run(tmp_path: Path) -> None:
    storage, out = Storage(), str(tmp_path / "out")
    job, plan = plan_job_and_load(storage, str(SAMPLE_CKPT), out, STAGED)
    assert plan is not None
    work = WorkLayout(job.work_url)
    extracts = [extract_unit(plan, p.index, storage, work, STAGED) for p in job.parts]
    merges = [merge_unit(plan, s.index, storage, out, work, STAGED) for s in job.shards]
    bad = {**merges[0].tensors}
    name = next(iter(bad))
    bad[name] = {**bad[name], "xxh3_128": "0" * 32}
    verifies = [verify_unit(plan, 0, storage, out, STAGED, expected=bad)] + [
        verify_unit(plan, m.shard, storage, out, STAGED, expected=m.tensors) for m in merges[1:]
    ]
    assert not verifies[0].ok
    stats = run_stats(job, STAGED, extracts=extracts, merges=merges, verifies=verifies,
                      seconds=1.0, tasks_executed={}, peak_rss_bytes=1)  # fmt: skip
    with pytest.raises(VerificationError, match=name):
        publish_job(plan, storage, out, work, STAGED, extracts=extracts, merges=merges,
                    verifies=verifies, stats=stats)  # fmt: skip
    assert not (tmp_path / "out" / "zerosafe-complete.json").exists()
    assert not Path(work.intermediate).exists(), "intermediates of a failed run were kept"


# -- the sequential driver ------------------------------------------------------------------------


def test_the_driver_cleans_up_a_custom_work_dir_like_the_flow(tmp_path: Path) -> None:
    work = tmp_path / "work" / "job"
    summary = convert_checkpoint(
        str(SAMPLE_CKPT), str(tmp_path / "out"), STAGED, work_url=str(work)
    )
    assert summary.status == "converted" and summary.stats is not None
    assert summary.stats.tasks_executed == {
        "extract": 3,
        "merge": len(summary.files),
        "verify": len(summary.files),
    }
    assert not work.exists() and (tmp_path / "work").exists(), (
        "removed more than the job's work area"
    )
    assert not (tmp_path / "out" / ".zerosafe-work").exists()
    assert not (tmp_path / "out" / ".zerosafe-lease.json").exists()


def test_the_driver_takes_the_work_lease(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = plan_job(Storage(), str(SAMPLE_CKPT), str(out), STAGED)
    lease = {
        "run_id": "other",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "heartbeat": time.time(),
    }
    (Path(job.work_url) / "lease.json").write_text(json.dumps(lease))
    with pytest.raises(LeaseHeldError, match="another run of this job"):
        convert_checkpoint(str(SAMPLE_CKPT), str(out), STAGED)
    assert not (out / "zerosafe-complete.json").exists()


def test_the_driver_summary_has_every_key_the_flow_summary_has(tmp_path: Path) -> None:
    summary = convert_checkpoint(
        str(SAMPLE_CKPT), str(tmp_path / "out"), ConvertOptions(direct=True)
    )
    flow_keys = {  # what the flow's summary always held
        "status", "output", "job_key", "files", "num_tensors", "aliases", "integrity", "notes",
        "warnings", "checks_passed", "peak_rss_bytes", "mode", "mode_reason",
        "source_bytes_read", "source_bytes_needed", "intermediate_bytes_written",
        "output_bytes_written", "rss_growth_bytes_by_stage", "rss_baseline_bytes",
        "tasks_executed", "source_read_ratio", "seconds", "throughput_bytes_per_second",
    }  # fmt: skip
    driver_keys = {"bytes_read", "bytes_written", "fp32_bytes"}  # what the driver's held
    assert set(summary.to_json()) == flow_keys | driver_keys
    manifest = json.loads((tmp_path / "out" / "zerosafe-manifest.json").read_text())
    old_flow_stats = {
        "mode", "mode_reason", "source_bytes_read", "source_bytes_needed",
        "intermediate_bytes_written", "output_bytes_written", "rss_growth_bytes_by_stage",
        "rss_baseline_bytes", "tasks_executed", "source_read_ratio",
    }  # fmt: skip
    old_driver_stats = {"seconds", "bytes_read", "source_bytes_read", "fp32_bytes",
                        "bytes_written", "peak_rss_bytes", "mode", "mode_reason"}  # fmt: skip
    assert set(manifest["stats"]) >= old_flow_stats | old_driver_stats


def test_a_merge_in_streams_writes_what_one_stream_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads filling their own ranges of one shard give its bytes, digests and CRC ledger."""
    from zerosafe.pipeline import merge_streams
    from zerosafe.stages import shards
    from zerosafe.stages.shards import _stream_bounds, check_integrity

    split: list[int] = []
    real = shards._copy_in_streams

    def copy_in_streams(jobs: Any, writer: Any, streams: int, *args: Any) -> int:
        split.append(streams)
        return real(jobs, writer, streams, *args)

    monkeypatch.setattr(shards, "_copy_in_streams", copy_in_streams)
    options = ConvertOptions(direct=True, dtype="bf16")
    storage, got = Storage(), {}
    for streams in (1, 3):
        out = str(tmp_path / f"out{streams}")
        job, plan = plan_job_and_load(storage, str(SAMPLE_CKPT), out, options)
        assert plan is not None and len(plan.shards) == 1 and len(plan.shard_tensors(0)) > 3
        with hold_work(storage, job):
            merged = merge_unit(
                plan, 0, storage, out, WorkLayout(job.work_url), options, streams=streams
            )
            assert verify_unit(plan, 0, storage, out, options, expected=merged.tensors).ok
            assert not check_integrity(plan, storage, [merged.ledger]).failed
            assert sum(len(pieces) for pieces in merged.ledger.values()) > 0
        shard = next((tmp_path / f"out{streams}").rglob(merged.file))
        got[streams] = (shard.read_bytes(), merged.tensors, merged.bytes_read)
    assert got[1] == got[3] and split == [3]  # the second merge did run in streams
    assert _stream_bounds([_Entry(n) for n in (10, 10, 10, 10)], 2) == [0, 2, 4]
    assert _stream_bounds([_Entry(n) for n in (100, 1, 1)], 3) == [0, 1, 2, 3]
    assert _stream_bounds([_Entry(n) for n in (5,)], 4) == [0, 1]
    # The last round's merges share the idle tasks' cores; the others run as one stream.
    assert [merge_streams(p, 35, 16, options) for p in (0, 31, 32, 34)] == [1, 1, 5, 5]
    assert merge_streams(0, 1, 2, options) == 2 and merge_streams(0, 32, 16, options) == 1
    assert merge_streams(4, 5, 1, options) == 1
    from zerosafe.config import TASK_OVERHEAD_BYTES

    # A task's buffers of 8 MiB hold one stream's 5 MiB, not two.
    small = ConvertOptions(memory=TASK_OVERHEAD_BYTES + 8 * 2**20, max_parallel_tasks=1)
    assert small.chunk_bytes == 2**20 and merge_streams(0, 1, 8, small) == 1


class _Entry:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
