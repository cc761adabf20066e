"""Helpers of the S3 tests: clients of the server, uploads and downloads, output comparison,
and the command line run in its own process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import REPO

ACCESS_KEY = "AKIAZEROSAFETESTKEY1"
SECRET_KEY = "zerosafe-test-secret-do-not-log-7f3a9c"
MOTO_PART_MIN_BYTES = 4096


@dataclass(frozen=True)
class MotoServer:
    url: str
    port: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def aws_env(home: Path, key: str = ACCESS_KEY, secret: str = SECRET_KEY) -> dict[str, str]:
    """Credentials as the AWS CLI reads them, and nothing from this machine's ~/.aws."""
    return {
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(home / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def with_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send `sig` to the process group `proc` leads (it was started in a new session)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def upload_folder(endpoint: str, folder: Path, bucket: str, prefix: str) -> str:
    client = s3_client(endpoint)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return f"s3://{bucket}/{prefix}"


def download_folder(endpoint: str, url: str, dest: Path) -> Path:
    """Every object under `url` into `dest` (keys below the prefix become relative paths)."""
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    client = s3_client(endpoint)
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix + "/"
    ):
        for obj in page.get("Contents", []):
            target = dest / obj["Key"][len(prefix) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["Key"], str(target))
    return dest


def object_keys(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    client = s3_client(endpoint)
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.extend(o["Key"] for o in page.get("Contents", []))
    return sorted(keys)


def incomplete_uploads(endpoint: str, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
    client = s3_client(endpoint)
    return list(client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []))


def assert_same_output(got: Path, want: Path) -> None:
    """Same weight files, byte for byte, and the same tensors (names, dtypes, bytes)."""
    from tests.helpers import load_output, same_bytes

    weights = sorted(p.name for p in want.iterdir() if p.name.startswith("model"))
    assert sorted(p.name for p in got.iterdir() if p.name.startswith("model")) == weights
    for name in weights:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name
    got_t, got_m = load_output(got)
    want_t, want_m = load_output(want)
    assert sorted(got_t) == sorted(want_t)
    assert all(same_bytes(got_t[k], want_t[k]) for k in want_t)
    assert got_m["tensors"] == want_m["tensors"]
    assert (got / "zerosafe-complete.json").exists()


def cli_env(base: dict[str, str], aws_home: Path, **extra: str) -> dict[str, str]:
    """`base` (a Prefect environment) with the test AWS environment and `extra`."""
    env = {k: v for k, v in base.items() if not k.startswith("AWS_")}
    env.update(aws_env(aws_home))
    env.update(extra)
    return env


def run_zerosafe(
    env: dict[str, str],
    *args: str,
    timeout: int = 300,
    check: bool = True,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python -m zerosafe_app.cli ARGS` in its own process group (killed whole when done)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerosafe_app.cli", *args],
        env=env,
        cwd=cwd or REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with_group(proc, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"zerosafe {' '.join(args)} timed out\n{out}\n{err}") from None
    finally:
        with_group(proc, signal.SIGKILL)  # an orphaned embedded Prefect server, if any
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    return done
