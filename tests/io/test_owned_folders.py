"""Temporary folders that record their owner (`zerosafe.io.owned_folders`): what a process
killed with SIGKILL leaves is found and removed by the next one, never a live owner's folder
(issue 37 item 9: one private Prefect server folder stayed per killed `--via prefect`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from zerosafe.io.owned_folders import (
    OWNER_FILE,
    PRIVATE_SERVER_PREFIX,
    find_owned_folders,
    owned_temp_folder,
    process_start_ticks,
)
from zerosafe.stages.clean import find_server_folders

_HOLD = """
import sys, time
from zerosafe.io.owned_folders import PRIVATE_SERVER_PREFIX, owned_temp_folder
with owned_temp_folder(PRIVATE_SERVER_PREFIX, parent=sys.argv[1]) as path:
    open(path + "/server.log", "w").write("a log")
    print(path, flush=True)
    time.sleep(600)
"""


def _holder(parent: Path) -> tuple[subprocess.Popen[str], Path]:
    """A child process holding a folder, and the folder."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(parent)], stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_owners_folder_is_removed_by_the_next_and_a_live_ones_kept(
    tmp_path: Path,
) -> None:
    killed, left = _holder(tmp_path)
    running, kept = _holder(tmp_path)
    try:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        assert (left / "server.log").exists(), "SIGKILL gives no chance to clean up"
        states = {Path(f.path): f.owner_alive for f in find_owned_folders(
            PRIVATE_SERVER_PREFIX, parent=str(tmp_path))}  # fmt: skip
        assert states == {left: False, kept: True}
        with owned_temp_folder(PRIVATE_SERVER_PREFIX, parent=str(tmp_path)) as mine:
            assert not left.exists() and kept.exists() and Path(mine).exists()
        assert not Path(mine).exists()
    finally:
        running.kill()
        running.wait()


def test_a_reused_pid_or_a_folder_without_its_record_for_long_is_not_an_owner(
    tmp_path: Path,
) -> None:
    reused = tmp_path / f"{PRIVATE_SERVER_PREFIX}reused"
    reused.mkdir()
    ticks = process_start_ticks(os.getpid())
    assert ticks is not None
    owner = {"pid": os.getpid(), "start_ticks": ticks - 1, "uid": os.geteuid(),
             "host": os.uname().nodename}  # fmt: skip
    (reused / OWNER_FILE).write_text(json.dumps(owner))
    young, old = (
        tmp_path / f"{PRIVATE_SERVER_PREFIX}young",
        tmp_path / f"{PRIVATE_SERVER_PREFIX}old",
    )
    young.mkdir()
    old.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    (tmp_path / f"{PRIVATE_SERVER_PREFIX}file").write_text("not a folder")
    states = {Path(f.path).name: f.owner_alive for f in find_owned_folders(
        PRIVATE_SERVER_PREFIX, parent=str(tmp_path))}  # fmt: skip
    assert states == {reused.name: False, young.name: True, old.name: False}
    with owned_temp_folder(PRIVATE_SERVER_PREFIX, parent=str(tmp_path)):
        # No record: perhaps a zerosafe from before the records, still running; left to clean.
        assert not reused.exists() and young.exists() and old.exists()


def test_clean_lists_the_folders_of_killed_owners_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what TMPDIR sets
    with owned_temp_folder(PRIVATE_SERVER_PREFIX) as mine:  # a live one: never listed
        killed, left = _holder(tmp_path)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        found = find_server_folders(older_than_seconds=0)
        assert [(f.kind, f.url, f.action) for f in found] == [
            ("server-folder", str(left), "remove")
        ]
        assert found[0].size_bytes == len("a log") + (left / OWNER_FILE).stat().st_size
        assert find_server_folders(older_than_seconds=3600)[0].action == "recent"
        assert Path(mine).exists()


def test_the_owner_record_keeps_its_keys_and_an_unreadable_one_counts_as_alive(
    tmp_path: Path,
) -> None:
    """`OwnerRecord` writes the keys owner files always had; values that are no owner's
    (a record of another kind) say nothing, so the folder is never taken for a dead one's."""
    with owned_temp_folder(PRIVATE_SERVER_PREFIX, parent=str(tmp_path)) as mine:
        written = json.loads((Path(mine) / OWNER_FILE).read_text())
        assert list(written) == ["pid", "start_ticks", "uid", "host"]
        assert written["pid"] == os.getpid()
    odd = tmp_path / f"{PRIVATE_SERVER_PREFIX}odd"
    odd.mkdir()
    (odd / OWNER_FILE).write_text(json.dumps({"pid": "12", "host": os.uname().nodename}))
    os.utime(odd, (time.time() - 7200, time.time() - 7200))
    (found,) = find_owned_folders(PRIVATE_SERVER_PREFIX, parent=str(tmp_path))
    assert found.owner_alive and found.owner_pid is None
