"""A real Prefect server (SQLite, or PostgreSQL on 127.0.0.1:5432), the `zerosafe` process
work pool, the deployments of deploy/prefect.yaml, and a worker: all started here, on
loopback, and stopped (whole process groups) afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.io.s3.conftest import aws_environment, aws_home, bucket, local_reference, moto, sample_s3  # noqa: F401
from tests.io.s3.support import aws_env, free_port

BIN = Path(sys.executable).parent
POSTGRES = "postgresql+asyncpg://postgres@127.0.0.1:5432/{db}"


def _stop(proc: subprocess.Popen[Any], *, sigint_twice: bool = False) -> None:
    if proc.poll() is not None:
        return
    try:
        if sigint_twice:  # SIGTERM does not stop `prefect worker start`: it needs SIGINT twice
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@dataclass
class Stack:
    """A running server (and, once started, a worker) with the env to talk to it."""

    url: str
    env: dict[str, str]
    home: Path
    procs: list[tuple[subprocess.Popen[Any], bool]] = field(default_factory=list)
    deploy_output: str = ""

    def prefect(
        self, *args: str, timeout: int = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(BIN / "prefect"), *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert proc.returncode == 0, (
                f"prefect {' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc

    def start_worker(self, log: Path, pool: str = "zerosafe") -> None:
        proc = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--limit", "4"],
            env=self.env, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.procs.append((proc, True))

    def client(self) -> Any:
        """A client of this server (not of whatever PREFECT_API_URL this process loaded)."""
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(api=self.url + "/api")

    def stop(self) -> None:
        for proc, twice in reversed(self.procs):
            _stop(proc, sigint_twice=twice)


def start_stack(tmp: Path, aws_dir: Path, database: str | None = None) -> Stack:
    home = tmp / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(aws_env(aws_dir))
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_WORKER_PREFETCH_SECONDS="2",
        PREFECT_LOGGING_LEVEL="INFO",
        PYTHONUNBUFFERED="1",
    )
    if database:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, cwd=tmp, stdout=open(tmp / "server.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    stack = Stack(url=f"http://127.0.0.1:{port}", env=env, home=home, procs=[(server, False)])
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(stack.url + "/api/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            stack.stop()
            raise AssertionError(
                "prefect server did not start:\n" + (tmp / "server.log").read_text()[-3000:]
            )
        time.sleep(0.5)
    return stack


def deploy(stack: Stack) -> None:
    stack.prefect("work-pool", "create", "zerosafe", "--type", "process", "--overwrite")
    proc = subprocess.run(
        ["bash", str(REPO / "deploy" / "deploy.sh")], env={**stack.env, "PREFECT": str(BIN / "prefect")},
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stack.deploy_output = proc.stdout


@contextlib.contextmanager
def deployed_stack(tmp: Path, aws_dir: Path, database: str | None = None) -> Iterator[Stack]:
    """A server with the deployments registered and one process worker, stopped on exit."""
    stack = start_stack(tmp, aws_dir, database)
    try:
        deploy(stack)
        stack.start_worker(tmp / "worker.log")
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def sqlite_stack(tmp_path_factory: pytest.TempPathFactory, aws_home: Path) -> Iterator[Stack]:  # noqa: F811
    with deployed_stack(tmp_path_factory.mktemp("prefect-sqlite"), aws_home) as stack:
        yield stack


@pytest.fixture(scope="module")
def postgres_stack(tmp_path_factory: pytest.TempPathFactory, aws_home: Path) -> Iterator[Stack]:  # noqa: F811
    db = f"zerosafe_test_{uuid.uuid4().hex[:12]}"
    psql = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-c"]
    made = subprocess.run([*psql, f"CREATE DATABASE {db}"], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.fail(f"could not create a PostgreSQL database on 127.0.0.1:5432: {made.stderr}")
    try:
        with deployed_stack(
            tmp_path_factory.mktemp("prefect-postgres"), aws_home, POSTGRES.format(db=db)
        ) as stack:
            yield stack
    finally:
        subprocess.run([*psql, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"], capture_output=True)


def params_json(**params: Any) -> str:
    return json.dumps(params)
