"""The storage facade on a real S3 server: exact ranged reads, multipart visibility, errors.

Requests are observed through the fault proxy, which sees what s3fs really sends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, SAMPLE_CKPT
from tests.io.s3.faultproxy import Fault, FaultProxy
from tests.io.s3.support import (
    SECRET_KEY,
    MotoServer,
    incomplete_uploads,
    object_keys,
    s3_client,
    upload_folder,
)
from zerosafe.errors import CheckpointFormatError, ConfigError, StorageError
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.s3 import (
    find_secret_options,
    fsspec_options,
    is_transient_error,
    parse_option_pairs,
)
from zerosafe.io.storage import Storage

KIB = 1024


def _put(moto: MotoServer, bucket: str, key: str, data: bytes) -> str:
    s3_client(moto.url).put_object(Bucket=bucket, Key=key, Body=data)
    return f"s3://{bucket}/{key}"


def test_large_read_is_concurrent_ranged_gets_of_exact_bytes(
    moto: MotoServer, bucket: str, proxy: FaultProxy
) -> None:
    data = os.urandom(1 << 20)
    url = _put(moto, bucket, "blob", data)
    storage = Storage({"endpoint_url": proxy.url, "range_size": 64 * KIB, "max_requests": 4})
    source = storage.open_source(url)
    buf = bytearray(600_000)
    source.readinto_at(123_457, memoryview(buf))
    assert bytes(buf) == data[123_457 : 123_457 + 600_000]
    gets = proxy.requests("GET", f"/{bucket}/blob")
    assert len(gets) == 10  # ceil(600000 / 65536)
    assert all(g.range is not None for g in gets)
    assert sum(g.body_bytes for g in gets) == 600_000  # not one byte more
    assert max(g.body_bytes for g in gets) == 64 * KIB
    assert 1 < proxy.peak_ranged_in_flight <= 4
    assert storage.counter.bytes_read == 600_000


def test_zip_directory_and_pickle_take_four_small_gets(
    moto: MotoServer, bucket: str, proxy: FaultProxy
) -> None:
    name = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    local = SAMPLE_CKPT / "global_step2" / name
    url = _put(moto, bucket, name, local.read_bytes())
    storage = Storage({"endpoint_url": proxy.url})
    zf = TorchZipFile(storage.open_source(url))
    zf.load()
    gets = proxy.requests("GET", f"/{bucket}/{name}")
    # The end records, the central directory, the pickle (with its local header), byteorder.
    assert len(gets) == 4, gets
    pickle_bytes = zf.records[zf.prefix + "data.pkl"].size_bytes
    read = sum(g.body_bytes for g in gets)
    assert zf.directory_bytes + pickle_bytes <= read <= zf.directory_bytes + pickle_bytes + 512
    assert read < local.stat().st_size / 10


def test_zip64_directory_is_found_with_two_reads(
    moto: MotoServer, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    from bench.forge import forge_checkpoint, transformer_shapes

    forge_checkpoint(
        tmp_path / "ckpt",
        shapes=transformer_shapes(width=64, layers=1, vocab=101, ffn=129),
        stage=2,
        world_size=2,
        zip64_threshold=0,  # every size and offset as a ZIP64 field
    )
    (path,) = sorted((tmp_path / "ckpt").glob("*/*rank_1*optim_states.pt"))
    url = _put(moto, bucket, path.name, path.read_bytes())
    storage = Storage({"endpoint_url": proxy.url})
    zf = TorchZipFile(storage.open_source(url))
    local = TorchZipFile(Storage().open_source(str(path)))
    assert zf.records == local.records
    gets = proxy.requests("GET", f"/{bucket}/{path.name}")
    assert len(gets) == 3  # end records, central directory, byteorder


def test_multipart_object_is_invisible_until_committed(
    moto: MotoServer, bucket: str, proxy: FaultProxy
) -> None:
    storage = Storage({"endpoint_url": proxy.url, "part_size": 16 * KIB, "max_requests": 2})
    url = f"s3://{bucket}/out/model.safetensors"
    data = os.urandom(50_000)
    sink = storage.open_sink(url)
    for i in range(0, len(data), 7_000):
        sink.write(memoryview(data)[i : i + 7_000])
    assert object_keys(moto.url, bucket) == []  # 3 parts sent, nothing visible
    assert len(incomplete_uploads(moto.url, bucket)) == 1
    sink.commit()
    assert (
        s3_client(moto.url).get_object(Bucket=bucket, Key="out/model.safetensors")["Body"].read()
        == data
    )
    assert incomplete_uploads(moto.url, bucket) == []
    parts = [r for r in proxy.requests("PUT") if "partNumber=" in r.query]
    assert len(parts) == 4  # 3 x 16 KiB + the 1,848-byte last part
    assert sink.num_parts == 4


def test_small_object_is_one_put_and_abort_leaves_nothing(
    moto: MotoServer, bucket: str, proxy: FaultProxy
) -> None:
    storage = Storage({"endpoint_url": proxy.url, "part_size": 16 * KIB})
    storage.write_bytes(f"s3://{bucket}/small.json", b"{}")
    (put,) = proxy.requests("PUT")
    assert "uploadId" not in put.query and "partNumber" not in put.query
    sink = storage.open_sink(f"s3://{bucket}/big")
    sink.write(os.urandom(40 * KIB))  # two parts uploaded
    assert len(incomplete_uploads(moto.url, bucket)) == 1
    sink.abort()
    assert incomplete_uploads(moto.url, bucket) == []
    assert object_keys(moto.url, bucket) == ["small.json"]


_KILLED_WRITER = """
import os, signal, sys
from zerosafe.io.storage import Storage
storage = Storage({"endpoint_url": sys.argv[1], "part_size": 16384})
sink = storage.open_sink(sys.argv[2])
sink.write(os.urandom(3 * 16384 + 100))
while sink._inflight:  # the parts are up; now die as a SIGKILLed run does
    sink._collect_oldest()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killed_upload_never_appears_and_clean_aborts_it(
    moto: MotoServer, bucket: str, tmp_path: Path
) -> None:
    from zerosafe.stages.clean import clean

    url = f"s3://{bucket}/out/model-00001-of-00002.safetensors"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_WRITER), moto.url, url],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert object_keys(moto.url, bucket) == []
    (upload,) = incomplete_uploads(moto.url, bucket)
    assert upload["Key"] == "out/model-00001-of-00002.safetensors"

    storage = Storage({"endpoint_url": moto.url})
    listed = clean(storage, f"s3://{bucket}/out", older_than_seconds=0, apply=False)
    assert [(f.kind, f.action, f.size_bytes) for f in listed] == [("upload", "remove", 3 * 16384)]
    assert len(incomplete_uploads(moto.url, bucket)) == 1  # dry run: nothing touched
    # While a live run holds the output's work area, its uploads are left alone. (Age is no
    # test here: moto reports every upload as initiated in 2010.)
    lease = f"s3://{bucket}/out/.zerosafe-work/0123456789abcdef/lease.json"
    held = {
        "run_id": "r",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "heartbeat": time.time(),
    }
    storage.write_bytes(lease, json.dumps(held).encode())
    kept = clean(storage, f"s3://{bucket}/out", older_than_seconds=0, apply=True)
    assert sorted((f.kind, f.action) for f in kept) == [
        ("upload", "live run"),
        ("work-area", "live run"),
    ]
    assert len(incomplete_uploads(moto.url, bucket)) == 1
    storage.remove(lease)
    removed = clean(storage, f"s3://{bucket}/out", older_than_seconds=0, apply=True)
    assert [f.action for f in removed] == ["removed"]
    assert incomplete_uploads(moto.url, bucket) == []


def test_clean_removes_abandoned_work_areas_and_keeps_live_ones(
    moto: MotoServer, bucket: str
) -> None:
    from zerosafe.stages.clean import clean

    storage = Storage({"endpoint_url": moto.url})
    base = f"s3://{bucket}/runs"
    dead = {
        "run_id": "a",
        "host": socket.gethostname(),
        "pid": 2**22 + 17,
        "heartbeat": time.time(),
    }
    live = {
        "run_id": "b",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "heartbeat": time.time(),
    }
    for out, lease in (("out-a", dead), ("out-b", live)):
        work = f"{base}/{out}/.zerosafe-work/0123456789abcdef"
        storage.write_bytes(f"{work}/plan/plan.json", b"{}")
        storage.write_bytes(f"{work}/intermediate/rank0.safetensors", b"x" * 100)
        storage.write_bytes(f"{work}/lease.json", json.dumps(lease).encode())
    found = clean(storage, base, older_than_seconds=0, apply=False)
    actions = {f.url.split("/")[4]: f.action for f in found if f.kind == "work-area"}
    assert actions == {"out-a": "remove", "out-b": "live run"}
    clean(storage, base, older_than_seconds=0, apply=True)
    left = object_keys(moto.url, bucket, "runs/")
    assert not any(k.startswith("runs/out-a/") for k in left)
    assert any(k.startswith("runs/out-b/.zerosafe-work/") for k in left)


def test_clean_cli_dry_run_by_default(moto: MotoServer, bucket: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    work = out / ".zerosafe-work" / "0123456789abcdef"
    (work / "plan").mkdir(parents=True)
    (work / "plan" / "plan.json").write_text("{}")
    partial = out / ".model.safetensors.0a1b2c3d.partial"
    partial.write_bytes(b"x" * 10)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [sys.executable, "-m", "zerosafe_app.cli", "clean", str(out), "--older-than", "0"]
    dry = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "would remove" in dry.stdout and "--apply" in dry.stdout
    assert work.exists() and partial.exists()
    done = subprocess.run([*run, "--apply"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not work.exists() and not partial.exists()


def test_permanent_errors_fail_fast_naming_url_and_fix(
    moto: MotoServer, bucket: str, proxy: FaultProxy
) -> None:
    storage = Storage({"endpoint_url": proxy.url})
    with pytest.raises(StorageError, match="bucket 'zs-missing-bucket' does not exist") as e:
        storage.listdir("s3://zs-missing-bucket/ckpt")
    assert "endpoint_url" in str(e.value)
    with pytest.raises(StorageError, match="does not exist"):
        storage.open_source("s3://zs-missing-bucket/ckpt/x.pt")
    with pytest.raises(CheckpointFormatError, match=f"s3://{bucket}/nothing.pt: file not found"):
        storage.open_source(f"s3://{bucket}/nothing.pt")

    url = _put(moto, bucket, "denied.pt", b"x" * 1000)
    source = storage.open_source(url)
    proxy.add(Fault("deny", "GET", "/denied.pt", times=100))
    started = time.monotonic()
    with pytest.raises(StorageError, match=f"{url}: access denied") as e:
        source.read_range(0, 100)
    assert time.monotonic() - started < 5  # no retry loop on a 403
    assert "credentials" in str(e.value) and SECRET_KEY not in str(e.value)
    assert isinstance(e.value.__cause__, PermissionError)
    assert not is_transient_error(e.value)
    assert proxy.faults_fired()["deny"] == 1
    proxy.add(Fault("deny", "PUT", "/forbidden/", times=100))
    with pytest.raises(StorageError, match="access denied"):
        storage.write_bytes(f"s3://{bucket}/forbidden/x.json", b"{}")


def test_throttling_that_outlasts_client_retries_is_transient(
    moto: MotoServer, bucket: str, proxy: FaultProxy
) -> None:
    url = _put(moto, bucket, "busy.bin", b"y" * 4096)
    storage = Storage(
        {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"total_max_attempts": 1}}}
    )
    source = storage.open_source(url)
    proxy.add(Fault("slowdown", "GET", "/busy.bin", times=100))
    with pytest.raises(OSError) as e:
        source.read_range(0, 10)
    assert is_transient_error(e.value), repr(e.value)
    assert 1 < proxy.faults_fired()["slowdown"] < 100  # s3fs retried, then gave up
    proxy.clear()
    assert source.read_range(0, 10) == b"y" * 10  # what the task's retry sees
    proxy.add(Fault("reset", "GET", "/busy.bin", times=1))
    assert source.read_range(0, 4096) == b"y" * 4096  # s3fs re-reads a body cut short


def test_endpoint_from_aws_endpoint_url(
    moto: MotoServer, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    upload_folder(moto.url, SAMPLE_CKPT, bucket, "ckpt")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    storage = Storage({"skip_instance_cache": True})
    assert storage.listdir(f"s3://{bucket}/ckpt") == ["global_step2", "latest"]


def test_options_refuse_secrets_and_translate() -> None:
    from zerosafe_app.flows.config import load_job_config

    assert parse_option_pairs(
        ["endpoint_url=http://h:1", "anon=true", "config_kwargs.read_timeout=5", "part_size=8MiB"]
    ) == {
        "endpoint_url": "http://h:1",
        "anon": True,
        "config_kwargs": {"read_timeout": 5},
        "part_size": "8MiB",
    }
    with pytest.raises(ConfigError, match="not accepted on the command line") as e:
        parse_option_pairs(["secret=hunter2"])
    assert "hunter2" not in str(e.value)
    assert find_secret_options({"client_kwargs": {"aws_secret_access_key": "x"}}) == [
        "storage_options.client_kwargs.aws_secret_access_key"
    ]
    with pytest.raises(ConfigError, match="credentials may not be job parameters") as e:
        load_job_config(source="s3://b/c", destination="s3://b/o", storage_options={"key": "AKIA1"})
    assert "AKIA1" not in str(e.value)
    cfg = load_job_config(
        source="s3://b/c", destination="s3://b/o", storage_options={"credentials": "secret/x"}
    )
    assert cfg.storage_options == {"credentials": "secret/x"}
    assert fsspec_options("s3", {"region": "eu-west-1", "anon": "true"}) == {
        "client_kwargs": {"region_name": "eu-west-1"},
        "anon": True,
        "use_listings_cache": False,
    }
    with pytest.raises(ConfigError, match="only the flow's tasks"):
        fsspec_options("s3", {"credentials": "secret/x"})


def test_local_writes_go_to_a_temporary_name_then_rename(tmp_path: Path) -> None:
    storage = Storage()
    target = tmp_path / "out" / "model.safetensors"
    sink = storage.open_sink(str(target))
    sink.write(b"x" * 1000)
    (temp,) = (tmp_path / "out").iterdir()
    assert temp.name.startswith(".model.safetensors.") and temp.name.endswith(".partial")
    assert not target.exists()
    sink.commit()
    assert target.read_bytes() == b"x" * 1000
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.safetensors"]
    failed = storage.open_sink(str(target))
    failed.write(b"y")
    failed.abort()
    assert target.read_bytes() == b"x" * 1000
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.safetensors"]
