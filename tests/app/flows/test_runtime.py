"""The local Prefect server `zerosafe convert` runs on: started once, reused, stopped when idle."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.app.flows.conftest import alive, convert_json, run_cli
from tests.conftest import SAMPLE_CKPT
from zerosafe_app.flows.runtime import STATE_NAME, stop_local_server

pytestmark = pytest.mark.slow


def test_commands_share_one_server_that_stops_when_idle(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    home = tmp_path / "prefect-home"
    env = {**prefect_env, "PREFECT_HOME": str(home), "ZEROSAFE_SERVER_IDLE_SECONDS": "4"}
    first = convert_json(env, str(SAMPLE_CKPT), str(tmp_path / "a"))
    assert first["status"] == "converted"
    state = json.loads((home / STATE_NAME).read_text())
    assert alive(state["pid"]) and alive(state["server_pid"])
    second = convert_json(env, str(SAMPLE_CKPT), str(tmp_path / "b"), "--dtype", "bf16")
    assert second["status"] == "converted"
    assert json.loads((home / STATE_NAME).read_text())["pid"] == state["pid"]  # reused
    deadline = time.monotonic() + 60
    while alive(state["pid"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(state["pid"]) and not alive(state["server_pid"]), "idle server kept"
    assert not (home / STATE_NAME).exists()
    # the next command starts a new one; stop_local_server ends it at once
    assert convert_json(env, str(SAMPLE_CKPT), str(tmp_path / "c"))["status"] == "converted"
    assert stop_local_server(home)
    assert not (home / STATE_NAME).exists()


def test_a_no_op_starts_no_server(prefect_env: dict[str, str], tmp_path: Path) -> None:
    home = tmp_path / "prefect-home"
    env = {**prefect_env, "PREFECT_HOME": str(home)}
    out = tmp_path / "out"
    assert convert_json(env, str(SAMPLE_CKPT), str(out))["status"] == "converted"
    assert stop_local_server(home)
    proc = run_cli(env, "convert", str(SAMPLE_CKPT), str(out))
    assert "nothing to do" in proc.stdout
    assert not (home / STATE_NAME).exists()  # answered from file stats; no server started


def test_a_private_server_ends_with_its_command(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    home = tmp_path / "prefect-home"
    env = {**prefect_env, "PREFECT_HOME": str(home), "ZEROSAFE_SERVER_IDLE_SECONDS": "0"}
    assert convert_json(env, str(SAMPLE_CKPT), str(tmp_path / "out"))["status"] == "converted"
    assert not (home / STATE_NAME).exists()


def test_the_local_database_drops_runs_past_their_retention(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """The local server runs Prefect's vacuum over flow runs: finished runs older than the
    retention (a week by default) go, with their task runs and logs. Here the retention is its
    minimum (just over an hour) and the runs are made to look three hours old."""
    import sqlite3

    home = tmp_path / "prefect-home"
    env = {
        **prefect_env,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD": "3700",
        "PREFECT_SERVER_SERVICES_DB_VACUUM_LOOP_SECONDS": "1",
    }
    try:
        assert convert_json(env, str(SAMPLE_CKPT), str(tmp_path / "out"))["status"] == "converted"
        db = sqlite3.connect(home / "prefect.db")
        assert db.execute("select count(*) from flow_run").fetchone()[0] >= 2
        assert db.execute("select count(*) from task_run").fetchone()[0] >= 4
        db.execute("update flow_run set end_time = datetime('now', '-3 hours')")
        db.commit()
        deadline = time.monotonic() + 60
        while db.execute("select count(*) from flow_run").fetchone()[0]:
            assert time.monotonic() < deadline, "old runs were not pruned"
            time.sleep(0.5)
        assert db.execute("select count(*) from task_run").fetchone()[0] == 0
    finally:
        stop_local_server(home)
