"""The flow `convert` against a real S3 server: the command line end to end, a run killed and
resumed, transient faults injected between s3fs and the server, and no credentials anywhere
Prefect keeps (parameters, logs, artifacts, blocks other than the Secret that holds them)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.io.s3.faultproxy import Fault, FaultProxy
from tests.io.s3.support import (
    ACCESS_KEY,
    SECRET_KEY,
    MotoServer,
    assert_same_output,
    cli_env,
    download_folder,
    incomplete_uploads,
    object_keys,
    run_zerosafe,
    s3_client,
    with_group,
)
from zerosafe.io.storage import Storage
from zerosafe.stages.output import inspect_output


@pytest.mark.slow
def test_cli_converts_s3_to_s3_and_reports_bytes_read(
    moto: MotoServer,
    bucket: str,
    sample_s3: str,
    proxy: FaultProxy,
    prefect_env: dict[str, str],
    aws_home: Path,
    local_reference: Path,
    tmp_path: Path,
) -> None:
    out = f"s3://{bucket}/out"
    done = run_zerosafe(
        cli_env(prefect_env, aws_home), "convert", sample_s3, out,
        "--storage-option", f"endpoint_url={proxy.url}", "--storage-option", "part_size=8KiB",
    )  # fmt: skip
    assert "from the source: 1.0" in done.stdout, done.stdout
    got = download_folder(moto.url, out, tmp_path / "got")
    assert_same_output(got, local_reference)
    stats = json.loads((got / "zerosafe-manifest.json").read_text())["stats"]
    on_wire = proxy.body_bytes("GET", f"/{bucket}/ckpt/")
    print(
        f"\nflow s3->s3: read {on_wire} B from S3; summary says {stats['source_bytes_read']} B "
        f"= {stats['source_read_ratio']} x the {stats['source_bytes_needed']} B needed"
    )
    assert stats["source_read_ratio"] <= 1.05
    assert on_wire <= 1.05 * stats["source_bytes_needed"]
    # `latest`, read by the command's check before the flow and by the flow's no-op check
    assert abs(on_wire - stats["source_bytes_read"]) <= 2 * len("global_step2")
    assert incomplete_uploads(moto.url, bucket) == []
    assert not any(".zerosafe-work" in k for k in object_keys(moto.url, bucket))
    verify = run_zerosafe(
        cli_env(prefect_env, aws_home, AWS_ENDPOINT_URL=moto.url), "verify", out, "--json"
    )
    assert json.loads(verify.stdout)["ok"]


@pytest.mark.slow
def test_killed_run_leaves_nothing_done_and_resumes(
    moto: MotoServer,
    bucket: str,
    sample_s3: str,
    proxy: FaultProxy,
    prefect_env: dict[str, str],
    aws_home: Path,
    local_reference: Path,
    tmp_path: Path,
) -> None:
    out = f"s3://{bucket}/out"
    env = cli_env(prefect_env, aws_home)
    options = [
        "--storage-option", f"endpoint_url={proxy.url}",
        "--storage-option", "part_size=8KiB", "--storage-option", "max_requests=1",
    ]  # fmt: skip
    # A slow link for the output's parts (written under the job's pending folder until
    # publish), so the kill lands in the middle of their upload.
    proxy.add(Fault("latency", "PUT", f"/{bucket}/out/.*/pending/model", times=1000))
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", sample_s3, out, *options],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    client = s3_client(moto.url)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (
                f"the run ended before it could be killed: {proc.stderr.read()[-3000:]}"
            )  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no upload of the output started"
            uploads = [
                u
                for u in incomplete_uploads(moto.url, bucket, "out/")
                if "/pending/model" in u["Key"]
            ]
            if uploads:
                parts = client.list_parts(
                    Bucket=bucket, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"]
                ).get("Parts", [])
                if parts:
                    break
            time.sleep(0.1)
    finally:
        with_group(proc, signal.SIGKILL)
        proc.wait(30)
    proxy.clear()

    storage = Storage({"endpoint_url": moto.url})
    keys = object_keys(moto.url, bucket, "out/")
    assert "out/model.safetensors" not in keys and "out/zerosafe-complete.json" not in keys
    assert inspect_output(storage, out, _job_key(keys)).kind == "partial"
    listed = run_zerosafe(
        env, "clean", out, "--older-than", "0", "--storage-option", f"endpoint_url={moto.url}"
    )
    assert "upload" in listed.stdout and "would remove" in listed.stdout, listed.stdout
    assert len(incomplete_uploads(moto.url, bucket)) == 1

    resumed = run_zerosafe(env, "convert", sample_s3, out, "--json", *options)
    summary = json.loads(resumed.stdout)
    assert summary["status"] == "converted"
    assert summary["tasks_executed"]["extract"] == 0  # every intermediate was kept and reused
    assert summary["tasks_executed"]["merge"] == 1
    assert_same_output(download_folder(moto.url, out, tmp_path / "got"), local_reference)

    run_zerosafe(
        env, "clean", out, "--older-than", "0", "--apply",
        "--storage-option", f"endpoint_url={moto.url}",
    )  # fmt: skip
    assert incomplete_uploads(moto.url, bucket) == []
    assert (tmp_path / "got" / "zerosafe-complete.json").exists()


def _job_key(keys: list[str]) -> str:
    (job,) = {k.split("/")[2] for k in keys if k.startswith("out/.zerosafe-work/")}
    return job


@pytest.mark.slow
def test_transient_faults_are_retried_and_no_credential_leaks(
    prefect_server: None,
    moto: MotoServer,
    bucket: str,
    sample_s3: str,
    proxy: FaultProxy,
    local_reference: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client

    from zerosafe_app.flows.convert import convert
    from zerosafe_app.tasks import credentials

    # Credentials only in a Secret block: none in this process's environment.
    Secret(value={"aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY}).save(
        "zs-test-s3", overwrite=True
    )
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    ckpt = f"/{bucket}/ckpt/"
    work = f"/{bucket}/out/.zerosafe-work/"
    proxy.stall_seconds = 2.5
    proxy.add(
        Fault("slowdown", "GET", ckpt + ".*optim_states", times=3, ranged_only=True),
        Fault("reset", "GET", ckpt + ".*optim_states", times=2, ranged_only=True),
        Fault("stall", "GET", ckpt + ".*model_states", times=1, ranged_only=True),
        # A 500 on an intermediate's upload fails its extract task once; it is retried.
        Fault("internal", "PUT", work + r".*intermediate/.*\.safetensors", times=1),
        Fault("slowdown", "PUT", work + ".*intermediate/", times=2),
        Fault("slowdown", "PUT", f"/{bucket}/out/model", times=2),
        # More throttling than s3fs retries: the merge task fails once, and is retried.
        Fault("slowdown", "GET", work + r".*intermediate/.*\.safetensors", times=6, ranged_only=True),
    )  # fmt: skip
    out = f"s3://{bucket}/out"
    result = convert(
        source=sample_s3,
        destination=out,
        storage_options={
            "endpoint_url": proxy.url,
            "credentials": "secret/zs-test-s3",
            "part_size": 8192,
            # No botocore retries: every fault reaches s3fs, and the worst reach the task.
            "config_kwargs": {"retries": {"total_max_attempts": 1}, "read_timeout": 1},
        },
    )
    assert result["status"] == "converted"
    fired = proxy.faults_fired()
    assert fired == {"slowdown": 13, "reset": 2, "stall": 1, "internal": 1}, fired
    assert_same_output(download_folder(moto.url, out, tmp_path / "got"), local_reference)
    assert incomplete_uploads(moto.url, bucket) == []  # failed attempts aborted theirs

    with get_client(sync_client=True) as client:
        from prefect.client.schemas.filters import (
            FlowFilter,
            FlowFilterName,
            FlowRunFilter,
            FlowRunFilterId,
        )
        from prefect.client.schemas.sorting import FlowRunSort

        # this conversion's task runs (the test server is shared with other tests)
        (job_run,) = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["convert-job"])),
            sort=FlowRunSort.START_TIME_DESC,
            limit=1,
        )
        # task-run states reach the database through events, shortly after the flow returns
        deadline = time.monotonic() + 60
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[job_run.id]))
            )
            settled = [r for r in runs if r.state is not None and r.state.is_final()]
            if (
                runs
                and len(settled) == len(runs)
                and any(r.name.startswith("merge ") for r in runs)
            ) or time.monotonic() > deadline:
                break
            time.sleep(1)
        for stage in ("extract", "merge"):
            stage_runs = [r for r in runs if r.name.startswith(stage + " ")]
            assert max(r.run_count for r in stage_runs) >= 2, [(r.name, r.run_count) for r in runs]
            assert all(r.state is not None and r.state.is_completed() for r in stage_runs)
        kept = [
            json.dumps(r.model_dump(mode="json"), default=str)
            for r in [*client.read_flow_runs(), *runs]
        ]
        kept += [a.model_dump_json() for a in client.read_artifacts()]
        kept += [log.message for log in client.read_logs()]
        blocks = client.read_block_documents(include_secrets=True)
    # Prefect may first open the result storage inside its event loop: resolving works there.
    credentials._cache.clear()

    async def resolve_in_loop() -> dict[str, object]:
        return credentials.resolve_storage_options({"credentials": "secret/zs-test-s3"})

    assert asyncio.run(resolve_in_loop())["secret"] == SECRET_KEY
    holders = [b.name for b in blocks if SECRET_KEY in json.dumps(b.data, default=str)]
    assert holders == ["zs-test-s3"]
    results = [b for b in blocks if b.block_type and "zerosafe" in b.block_type.slug]
    assert results and all(
        b.data["settings"]["credentials"] == "secret/zs-test-s3" for b in results
    )
    assert any("convert" in k for k in kept)
    for text in kept:
        assert SECRET_KEY not in text
        assert ACCESS_KEY not in text
