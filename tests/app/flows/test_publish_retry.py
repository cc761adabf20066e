"""Publish is safe to retry and cleanup is its own step (issue 24 item 8).

Before the fix, `publish` wrote the marker and then removed the work area in one retried task:
a transient error while removing retried the whole task, which then failed on the missing
intermediates, and a complete, verified output was reported as a failed run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect.logging import disable_run_logger

from tests.conftest import SAMPLE_CKPT
from tests.helpers import load_output
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.io.storage import Storage
from zerosafe.stages.clean import find_leftovers
from zerosafe.stages.results import JobPlan
from zerosafe_app.tasks._common import Job
from zerosafe_app.tasks.extract import extract
from zerosafe_app.tasks.inspect import inspect
from zerosafe_app.tasks.merge import merge
from zerosafe_app.tasks.verify import verify

STAGED = ConvertOptions(max_shard_size=20_000, dtype="bf16")
STATS = {"mode": "staged", "mode_reason": "", "source_bytes_read": 1, "source_bytes_needed": 1,
         "intermediate_bytes_written": 0, "output_bytes_written": 0, "bytes_read": 0,
         "bytes_written": 0, "fp32_bytes": 0}  # fmt: skip


@pytest.fixture
def no_run_logger() -> Iterator[None]:
    with disable_run_logger():
        yield


def _cleanup_fails(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make removing the work files fail (a bucket policy that denies deletes), recording
    each attempt."""
    attempts: list[str] = []

    def refuse(storage: Any, out_url: str, job_key: str, work_url: str, *, keep: bool) -> None:
        attempts.append(work_url)
        raise PermissionError(f"{work_url}: AccessDenied on DeleteObjects")

    monkeypatch.setattr("zerosafe.pipeline.finish_work", refuse)
    return attempts


def test_publish_again_with_the_same_inputs_returns_the_same_result(
    tmp_path: Path, no_run_logger: None
) -> None:
    from zerosafe_app.tasks.publish import finish, publish

    out = tmp_path / "out"
    job = JobPlan.from_json(inspect.fn(str(SAMPLE_CKPT), str(out), STAGED))
    task_job = Job(str(SAMPLE_CKPT), str(out), job.work_url, job.job_key, STAGED, {})
    j = task_job.as_dict()
    extracts = [extract.fn(j, p.index, p.rank, p.label) for p in job.parts]
    n = len(job.shards)
    merges = [merge.fn(j, s.index, s.index + 1, n, fingerprint="f") for s in job.shards]
    verifies = [
        verify.fn(j, m["shard"], m["shard"] + 1, n, m["tensors"], fingerprint="f") for m in merges
    ]
    first = publish.fn(j, extracts, merges, verifies, STATS)
    marker = (out / "zerosafe-complete.json").read_bytes()
    again = publish.fn(j, extracts, merges, verifies, STATS)  # a retry after the marker
    assert again == first
    assert (out / "zerosafe-complete.json").read_bytes() == marker, "published twice"
    assert Path(job.work_url).exists(), "publish removed the work area; cleanup is its own step"
    finish.fn(j)
    finish.fn(j)  # and cleanup is safe to retry too
    assert not (out / ".zerosafe-work").exists()
    assert load_output(out)[0]


def test_a_failed_cleanup_warns_and_the_sequential_run_is_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attempts = _cleanup_fails(monkeypatch)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        summary = convert_checkpoint(str(SAMPLE_CKPT), str(out), STAGED)
    assert attempts and summary.status == "converted"
    assert any("zerosafe clean" in w for w in summary.warnings), summary.warnings
    assert "zerosafe clean" in caplog.text
    assert (out / "zerosafe-complete.json").exists() and load_output(out)[0]
    assert (out / ".zerosafe-work").exists(), "the work files are left for `zerosafe clean`"
    monkeypatch.undo()
    left = find_leftovers(Storage(), str(out), older_than_seconds=0)
    assert [(x.kind, x.action) for x in left] == [("work-area", "remove")], left
    assert convert_checkpoint(str(SAMPLE_CKPT), str(out), STAGED).status == "already-complete"


@pytest.mark.slow
def test_a_failed_cleanup_warns_and_the_flow_run_is_converted(
    prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zerosafe_app.flows.convert import convert

    attempts = _cleanup_fails(monkeypatch)
    out = tmp_path / "out"
    result = convert(
        source=str(SAMPLE_CKPT), destination=str(out), max_shard_size="20KB", dtype="bf16",
        mode="staged",
    )  # fmt: skip
    assert attempts and result["status"] == "converted"
    assert any("zerosafe clean" in w for w in result["warnings"]), result["warnings"]
    assert (out / "zerosafe-complete.json").exists() and load_output(out)[0]
    assert (out / ".zerosafe-work").exists()
