"""A real S3 server on loopback (moto's server mode), the fault proxy in front of it, the sample
checkpoint in a fresh bucket, and the local conversion every S3 conversion must equal.

The server runs in its own process group, killed whole at the end of the session. It accepts
parts as small as 4 KiB (`S3_UPLOAD_PART_MIN_SIZE`) so multipart uploads can be tested on the
small sample; zerosafe's default part size (8 MiB) is above S3's real 5 MiB minimum.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SAMPLE_CKPT
from tests.io.s3.faultproxy import FaultProxy
from tests.io.s3.support import (
    MOTO_PART_MIN_BYTES,
    MotoServer,
    aws_env,
    free_port,
    s3_client,
    upload_folder,
    with_group,
)


@pytest.fixture(scope="session")
def aws_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aws-home")


@pytest.fixture(scope="session", autouse=True)
def aws_environment(aws_home: Path) -> Iterator[None]:
    """This process's AWS environment for the S3 tests (restored afterwards)."""
    names = [*aws_env(aws_home), "AWS_PROFILE", "AWS_ENDPOINT_URL"]
    saved = {k: os.environ.get(k) for k in names}
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    os.environ.update(aws_env(aws_home))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """`moto_server -H 127.0.0.1 -p PORT` on a free port, in its own process group."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    exe = Path(sys.executable).parent / "moto_server"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(MOTO_PART_MIN_BYTES)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*cmd, "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {log.read_text()}") from None
                time.sleep(0.2)
        yield MotoServer(url, port)
    finally:
        with_group(proc, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with_group(proc, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture
def bucket(moto: MotoServer) -> str:
    """A fresh, empty bucket (created with boto3: s3fs mkdir fails on us-east-1)."""
    name = f"zs-{uuid.uuid4().hex[:12]}"
    s3_client(moto.url).create_bucket(Bucket=name)
    return name


@pytest.fixture
def sample_s3(moto: MotoServer, bucket: str) -> str:
    """The shipped ZeRO-3 sample checkpoint, uploaded to `s3://BUCKET/ckpt`."""
    return upload_folder(moto.url, SAMPLE_CKPT, bucket, "ckpt")


@pytest.fixture
def proxy(moto: MotoServer) -> Iterator[FaultProxy]:
    """The fault proxy in front of the server (no faults until a test adds some)."""
    p = FaultProxy(upstream_port=moto.port, max_seconds=300).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="session")
def local_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample converted locally (engine, default options): what every S3 run must equal."""
    from zerosafe.config import ConvertOptions
    from zerosafe.driver import convert_checkpoint

    out = tmp_path_factory.mktemp("reference") / "out"
    convert_checkpoint(str(SAMPLE_CKPT), str(out), ConvertOptions())
    return out
