"""The flow on a real Dask cluster on loopback: a scheduler and two worker processes started by
the test, tasks spread over both, output bit-exact."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.flows.conftest import journal
from tests.conftest import REPO, SAMPLE_CKPT
from tests.helpers import load_output, same_bytes
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`dask scheduler` and `dask worker --nworkers 2` on 127.0.0.1; yields the address."""
    logs = tmp_path_factory.mktemp("dask")
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    scheduler = subprocess.Popen(
        [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
        stdout=open(logs / "scheduler.log", "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    workers = subprocess.Popen(
        [str(BIN / "dask"), "worker", address, "--nworkers", "2", "--nthreads", "1", "--memory-limit", "1GiB",
         "--no-dashboard", "--host", "127.0.0.1", "--local-directory", str(logs)],
        stdout=open(logs / "workers.log", "wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
    )  # fmt: skip
    try:
        from distributed import Client

        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(address, timeout=5) as client:
                    if len(client.scheduler_info()["workers"]) >= 2:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    "the Dask workers did not come up:\n"
                    + (logs / "workers.log").read_text()[-3000:]
                )
            time.sleep(1)
        yield address
    finally:
        _stop(workers)
        _stop(scheduler)


def test_flow_runs_its_tasks_on_two_dask_workers(dask_cluster: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = (
        "import json; from zerosafe_app.flows.runtime import configure_embedded_prefect; configure_embedded_prefect();"
        "from zerosafe_app.flows.convert import convert;"
        f"print(json.dumps(convert(source={str(SAMPLE_CKPT)!r}, destination={str(out)!r}, runner='dask',"
        f" dask_address={dask_cluster!r}, max_shard_size='20KB', keep_work=True, mode='staged')))"
    )
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["status"] == "converted"

    (work,) = (out / ".zerosafe-work").iterdir()
    ran = [e for e in journal(work) if e["stage"] in ("extract", "merge", "verify")]
    pids = {e["pid"] for e in ran}
    print(f"\n{len(ran)} tasks ran in worker processes {sorted(pids)}")
    assert (
        len(ran)
        == summary["tasks_executed"]["extract"]
        + summary["tasks_executed"]["merge"]
        + summary["tasks_executed"]["verify"]
    )
    assert len(pids) >= 2, "all tasks ran in one Dask worker"
    assert (work / "results").is_dir() and len(list((work / "results").iterdir())) >= len(ran)

    ref = tmp_path / "ref"
    convert_checkpoint(str(SAMPLE_CKPT), str(ref), ConvertOptions(max_shard_size=20_000))
    ours, manifest = load_output(out)
    theirs, _ = load_output(ref)
    assert set(ours) == set(theirs)
    for key in ours:
        assert same_bytes(ours[key], theirs[key]), key
