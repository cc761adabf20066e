"""The flow `convert`: same bytes as the engine, named tasks, artifacts, resume, caching."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.app.flows.conftest import convert_json, journal, run_cli, work_dir
from tests.conftest import SAMPLE_CKPT
from tests.helpers import load_output, same_bytes
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint

SHARD_ARGS = ("--max-shard-size", "20KB", "--mode", "staged")  # every stage runs


def _latest_subflow_run(client, name: str):  # type: ignore[no-untyped-def]
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    runs = client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[name])),
        sort=FlowRunSort.START_TIME_DESC,
        limit=1,
    )
    return runs[0]


def _assert_engine_output(out: Path, ref: Path) -> None:
    """`out` (the sample in 20 KB bf16 shards) holds the engine's bytes, checksums and job."""
    convert_checkpoint(
        str(SAMPLE_CKPT), str(ref), ConvertOptions(max_shard_size=20_000, dtype="bf16")
    )
    ours, manifest = load_output(out)
    theirs, ref_manifest = load_output(ref)
    assert set(ours) == set(theirs)
    for key in ours:
        assert same_bytes(ours[key], theirs[key]), key
        assert manifest["tensors"][key]["xxh3_128"] == ref_manifest["tensors"][key]["xxh3_128"]
    assert manifest["job_key"] == ref_manifest["job_key"]


@pytest.mark.slow
def test_flow_matches_engine_and_names_its_tasks(prefect_server: None, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
    )

    from zerosafe_app.flows.convert import convert, job_slug

    out = tmp_path / "flow"
    result = convert(
        source=str(SAMPLE_CKPT),
        destination=str(out),
        max_shard_size="20KB",
        dtype="bf16",
        mode="staged",
    )
    assert result["status"] == "converted" and len(result["files"]) > 1
    n = len(result["files"])
    _assert_engine_output(out, tmp_path / "engine")

    with get_client(sync_client=True) as client:
        run = _latest_subflow_run(client, "convert-job")
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))
        )
        names = sorted(t.name for t in tasks)
        assert names == sorted(
            ["inspect", "publish", "finish"]
            + [f"extract rank {r} part 0" for r in range(3)]
            + [f"merge shard {i}/{n}" for i in range(1, n + 1)]
            + [f"verify shard {i}/{n}" for i in range(1, n + 1)]
        )
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
        slug = job_slug(str(out))
        progress = [a for a in artifacts if a.type == "progress"]
        assert progress and float(progress[0].data) == pytest.approx(100.0)
        assert progress[0].key == f"zerosafe-{slug}-progress"
        summary = [a for a in artifacts if a.key == f"zerosafe-{slug}"]
        assert (
            summary and "tasks executed" in summary[0].data and "checks passed" in summary[0].data
        )


@pytest.mark.slow
def test_resume_reruns_exactly_what_vanished(prefect_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = convert_json(prefect_env, str(SAMPLE_CKPT), str(out), *SHARD_ARGS, "--keep-work")
    assert first["tasks_executed"] == {"extract": 3, "merge": 5, "verify": 5}
    work = work_dir(out)
    reference = {p.name: p.read_bytes() for p in out.glob("model*")}

    # 1. An intermediate vanishes: only its extract runs again; the merges that read it stay
    #    cached because the re-extracted file has the same content hash. Every verify runs
    #    again: a verify result is never reused from an earlier run.
    (out / "zerosafe-complete.json").unlink()
    (work / "intermediate" / "rank00001-part0000.safetensors").unlink()
    t0 = time.time()
    second = convert_json(prefect_env, str(SAMPLE_CKPT), str(out), *SHARD_ARGS, "--keep-work")
    assert second["tasks_executed"] == {"extract": 1, "merge": 0, "verify": 5}
    ran = [(e["stage"], e["index"]) for e in journal(work) if e["time"] >= t0]
    assert ran[-1] == ("publish", 0)
    verifies = [("verify", i) for i in range(5)]
    assert sorted(ran) == sorted([("extract", 1), ("publish", 0), *verifies])
    stats = json.loads((out / "zerosafe-manifest.json").read_text())["stats"]
    assert stats["bytes_read"] >= sum(p.stat().st_size for p in out.glob("model-*"))

    # 2. An output shard vanishes: its merge runs again, and every verify.
    (out / "zerosafe-complete.json").unlink()
    (out / "model-00003-of-00005.safetensors").unlink()
    third = convert_json(prefect_env, str(SAMPLE_CKPT), str(out), *SHARD_ARGS, "--keep-work")
    assert third["tasks_executed"] == {"extract": 0, "merge": 1, "verify": 5}

    # 3. A shard changed after it was verified: verify runs again (and catches it).
    (out / "zerosafe-complete.json").unlink()
    shard = out / "model-00002-of-00005.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = run_cli(
        prefect_env, "convert", str(SAMPLE_CKPT), str(out), *SHARD_ARGS, "--keep-work", check=False
    )
    assert (
        proc.returncode == 2
        and "checksum" in proc.stderr
        and "model-00002-of-00005.safetensors" in proc.stderr
    )
    assert not (out / "zerosafe-complete.json").exists()
    shard.unlink()
    convert_json(prefect_env, str(SAMPLE_CKPT), str(out), *SHARD_ARGS)
    assert {p.name: p.read_bytes() for p in out.glob("model*")} == reference
    assert not (out / ".zerosafe-work").exists()


@pytest.mark.slow
def test_run_stats_count_this_runs_tasks_whatever_the_workers_clocks(
    prefect_server: None, tmp_path: Path
) -> None:
    """Issue 24, 12: the stats once kept the journal entries stamped at or after the run's
    start by the flow's clock, so entries a worker with a clock ahead wrote in an earlier run
    counted again (and a worker behind lost this run's). They are selected by run id now."""
    from zerosafe_app.flows.convert import convert

    out = tmp_path / "out"
    kw = {"max_shard_size": "20KB", "mode": "staged", "keep_work": True}
    first = convert(source=str(SAMPLE_CKPT), destination=str(out), **kw)
    assert first["tasks_executed"] == {"extract": 3, "merge": 5, "verify": 5}
    work = work_dir(out)
    first_names = {p.name for p in (work / "journal").glob("*.json")}
    # That run's workers' clocks were an hour ahead.
    for entry in (work / "journal").glob("*.json"):
        data = json.loads(entry.read_text())
        entry.write_text(json.dumps({**data, "time": data["time"] + 3600}))
    (out / "zerosafe-complete.json").unlink()
    (work / "intermediate" / "rank00001-part0000.safetensors").unlink()
    second = convert(source=str(SAMPLE_CKPT), destination=str(out), **kw)
    assert second["tasks_executed"] == {"extract": 1, "merge": 0, "verify": 5}
    entries = {p.name: json.loads(p.read_text()) for p in (work / "journal").glob("*.json")}
    first_runs = {e["run_id"] for n, e in entries.items() if n in first_names}
    second_runs = {e["run_id"] for n, e in entries.items() if n not in first_names}
    assert len(first_runs) == len(second_runs) == 1 and first_runs != second_runs


@pytest.mark.slow
def test_rerun_of_a_complete_conversion_reads_no_checkpoint_byte(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(SAMPLE_CKPT, ckpt)
    out = tmp_path / "out"
    convert_json(prefect_env, str(ckpt), str(out))
    # Replace every checkpoint file's bytes, keeping size and mtime: a run that reads any of
    # them fails; one that trusts stats and the completion marker does not.
    for f in (ckpt / "global_step2").iterdir():
        st = f.stat()
        f.write_bytes(b"\0" * st.st_size)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    started = time.monotonic()
    again = convert_json(prefect_env, str(ckpt), str(out))
    print(
        f"\nre-run of a complete conversion: {time.monotonic() - started:.1f} s (embedded Prefect start included)"
    )
    assert again["status"] == "already-complete"
    # ...while a different option must plan, read the (now garbage) files, and refuse them.
    proc = run_cli(prefect_env, "convert", str(ckpt), str(tmp_path / "other"), check=False)
    assert proc.returncode == 2 and "not a torch checkpoint" in proc.stderr


def test_job_config_from_yaml_with_overrides(tmp_path: Path) -> None:
    from zerosafe_app.flows.config import load_job_config

    conf = tmp_path / "job.yaml"
    conf.write_text(
        "source: /ckpt\ndestination: /out\ndtype: bf16\nmax_shard_size: 2GB\nmemory: 512MiB\n"
    )
    cfg = load_job_config(str(conf), dtype="fp16", tag=None)
    assert cfg.dtype == "fp16" and cfg.max_shard_size == 2 * 10**9 and cfg.memory == 512 * 2**20
    assert cfg.options().dtype == "float16"


def test_file_sha256_from_yaml_parameter_and_flag(tmp_path: Path) -> None:
    from zerosafe_app.cli import _options, _parser
    from zerosafe_app.flows.config import load_job_config

    conf = tmp_path / "job.yaml"
    conf.write_text("source: /ckpt\ndestination: /out\nfile_sha256: true\n")
    assert load_job_config(str(conf)).options().file_sha256
    assert not load_job_config(str(conf), file_sha256=False).options().file_sha256
    assert not load_job_config(None, source="/a", destination="/b").options().file_sha256
    argv = ["convert", "/ckpt", str(tmp_path / "out")]
    assert _options(_parser().parse_args([*argv, "--file-sha256"])).file_sha256
    assert not _options(_parser().parse_args(argv)).file_sha256


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "match"),
    [
        ("source: /a\ndestination: /b\nshard_size: 5GB\n", {}, "`shard_size`: unknown key"),
        ("source: /a\ndestination: /b\n", {"dtype": "int8"}, "`dtype`"),
        (
            "source: /a\ndestination: /b\n",
            {"runner": "dask"},
            "`runner: dask` needs `dask_address`",
        ),
        (
            "source: s3://bucket/ckpt\ndestination: /b\nmode: direct\n",
            {},
            "`mode: direct` .* needs a local or NFS path",
        ),
        ("source: /a\ndestination: /b\nmemory: 1MB\n", {}, "`memory` budget"),
        (
            "source: /a\ndestination: /b\nmax_shard_size: lots\n",
            {},
            "`max_shard_size`: 'lots' is not a size",
        ),
        ("destination: /b\n", {}, "`source`: Field required"),
    ],
)
def test_job_config_refuses_bad_keys_by_name(
    tmp_path: Path, yaml_text: str, overrides: dict, match: str
) -> None:
    from zerosafe.errors import ConfigError
    from zerosafe_app.flows.config import load_job_config

    conf = tmp_path / "job.yaml"
    conf.write_text(yaml_text)
    with pytest.raises(ConfigError, match=match):
        load_job_config(str(conf), **overrides)


def test_example_conf_is_valid() -> None:
    from tests.conftest import REPO
    from zerosafe_app.flows.config import JobConfig, load_job_config

    cfg = load_job_config(str(REPO / "conf" / "example.yaml"))
    documented = (REPO / "conf" / "example.yaml").read_text()
    for field in JobConfig.model_fields:
        assert f"{field}:" in documented, f"conf/example.yaml does not document `{field}`"
    assert json.dumps(cfg.model_dump())


@pytest.mark.slow
def test_flow_runs_units_in_worker_processes_where_asked(
    prefect_server: None, tmp_path: Path, monkeypatch
) -> None:
    """ZEROSAFE_WORKERS=processes: the flow's extract, merge and verify tasks hand their units
    to worker processes (the real pool, counted), the bytes are the engine's, the summary
    says so, and the workers are stopped when the run ends."""
    from zerosafe_app.flows.convert import convert
    from zerosafe_app.tasks import _common

    started: list[int] = []

    class CountedPool(_common.UnitPool):
        def __init__(self, workers: int, shared: dict | None = None, **kw: bool) -> None:
            started.append(workers)
            super().__init__(workers, shared, **kw)

    closed: list[int] = []
    real_close = _common.UnitPool.close

    def close(pool: _common.UnitPool) -> None:
        closed.append(pool.workers)
        real_close(pool)

    monkeypatch.setattr(_common, "UnitPool", CountedPool)
    monkeypatch.setattr(_common.UnitPool, "close", close)
    monkeypatch.setenv("ZEROSAFE_WORKERS", "processes")
    out = tmp_path / "flow"
    result = convert(
        source=str(SAMPLE_CKPT), destination=str(out), max_shard_size="20KB", dtype="bf16",
        mode="staged", max_parallel_tasks=2,
    )  # fmt: skip
    assert result["status"] == "converted" and len(result["files"]) > 1
    assert started == [2] and closed == [2] and not _common._pools
    assert any("2 worker processes" in note for note in result["notes"])
    _assert_engine_output(out, tmp_path / "engine")
