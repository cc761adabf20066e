"""Temporary folders that belong to one process, and what is left of them once it is gone.

`zerosafe convert --via prefect` with no Prefect API configured starts a private server whose
log lives in a temporary folder (`zerosafe_app.flows.runtime.private_server`). The command
removes it when it ends, but a SIGKILL gives it no chance to: one folder per killed command
stayed. So each such folder records its owner (`owner.json`: pid, the process's start time,
user and host), the next one made with the same prefix removes those whose owner is gone, and
`zerosafe clean` lists them (`zerosafe.stages.clean`, through `zerosafe_app.clean_cli`).

The names live here, in the engine, so that `clean` knows them without importing the app (and
Prefect). The owner is told apart from a later process given the same pid by its start time
(`/proc/PID/stat`, field 22: clock ticks since boot, see proc(5)).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zerosafe.io.lease import pid_alive

__all__ = [
    "OWNER_FILE",
    "PRIVATE_SERVER_PREFIX",
    "OwnedFolder",
    "find_owned_folders",
    "owned_temp_folder",
    "process_start_ticks",
    "remove_stale_folders",
]

log = logging.getLogger(__name__)

PRIVATE_SERVER_PREFIX = "zerosafe-prefect-"
"""Name prefix of a `--via prefect` command's private server folder (with its `server.log`)."""

OWNER_FILE = "owner.json"

_NO_RECORD_GRACE_SECONDS = 60.0
"""A folder is given its owner record right after it is made; one without a record for longer
than this was left by a process killed in between, or by a zerosafe before the records."""


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot); None where it is gone, is a
    zombie (dead, not yet reaped), or `/proc` does not say (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after
    # the last one; the fields after it start at field 3 (the state).
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return None if fields[0] == b"Z" else int(fields[22 - 3])
    except (IndexError, ValueError):
        return None


def _owner_record() -> dict[str, Any]:
    pid = os.getpid()
    return {
        "pid": pid,
        "start_ticks": process_start_ticks(pid),
        "uid": os.geteuid(),
        "host": socket.gethostname(),
    }


def _owner_alive(owner: dict[str, Any]) -> bool:
    """Whether the process that made a folder still runs; True where that cannot be known
    (another host, an unreadable record), so that nothing in use is ever removed."""
    if owner.get("host") != socket.gethostname():
        return True
    try:
        pid = int(owner["pid"])
    except (KeyError, TypeError, ValueError):
        return True
    started = owner.get("start_ticks")
    if started is None or not os.path.isdir("/proc/self"):  # no start time to compare
        return pid_alive(pid)
    # Gone, a zombie, or a later process given the same pid: not the owner.
    return bool(process_start_ticks(pid) == started)


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnedFolder:
    """A temporary folder of this user made with a prefix, and whether its owner runs."""

    path: str
    size_bytes: int
    age_seconds: float
    owner_pid: int | None
    """None: the folder holds no readable owner record."""
    owner_alive: bool


def _read_owner(path: str) -> dict[str, Any] | None:
    record = os.path.join(path, OWNER_FILE)
    try:
        st = os.lstat(record)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            return None
        with open(record, "rb") as f:
            owner = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _size_and_mtime(path: str) -> tuple[int, float]:
    size, newest = 0, os.lstat(path).st_mtime
    for folder, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, name))
                size += st.st_size
                newest = max(newest, st.st_mtime)
    return size, newest


def find_owned_folders(prefix: str, *, parent: str | None = None) -> list[OwnedFolder]:
    """This user's folders named `prefix*` in `parent` (default: the temporary folder,
    `TMPDIR`), oldest first; other users' folders and anything not a folder are skipped.

    A folder without an owner record counts as alive while it is younger than a minute (it
    may be being made), and as gone after that.
    """
    parent = tempfile.gettempdir() if parent is None else parent
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return []
    now = time.time()
    found = []
    for name in names:
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            size, newest = _size_and_mtime(path)
        except OSError:
            continue  # removed meanwhile
        owner = _read_owner(path)
        alive = (
            _owner_alive(owner)
            if owner is not None
            else now - st.st_mtime < _NO_RECORD_GRACE_SECONDS
        )
        pid = owner.get("pid") if owner is not None else None
        found.append(
            OwnedFolder(
                path=path,
                size_bytes=size,
                age_seconds=max(0.0, now - newest),
                owner_pid=pid if isinstance(pid, int) else None,
                owner_alive=alive,
            )
        )
    return sorted(found, key=lambda f: -f.age_seconds)


def remove_stale_folders(prefix: str, *, parent: str | None = None) -> list[str]:
    """Remove this user's `prefix*` folders whose recorded owner is gone; returns their paths.

    A folder without a record is left to `zerosafe clean` (which asks for its age): it may
    belong to a zerosafe from before the records that still runs.
    """
    removed = []
    for folder in find_owned_folders(prefix, parent=parent):
        if folder.owner_alive or folder.owner_pid is None:
            continue
        shutil.rmtree(folder.path, ignore_errors=True)  # another command may remove it too
        log.info("removed %s, left by process %s (killed)", folder.path, folder.owner_pid)
        removed.append(folder.path)
    return removed


@contextlib.contextmanager
def owned_temp_folder(prefix: str, *, parent: str | None = None) -> Iterator[str]:
    """A new temporary folder (mode 0700) for the block, recording this process as its
    owner, removed when the block ends; first, the `prefix*` folders whose recorded owner is
    gone (killed before it could remove its own) are removed.

    Args:
        prefix: The folder's name prefix (`PRIVATE_SERVER_PREFIX`).
        parent: Where to make it (default: the temporary folder, `TMPDIR`).
    """
    remove_stale_folders(prefix, parent=parent)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        with open(os.path.join(path, OWNER_FILE), "w", encoding="utf-8") as f:
            json.dump(_owner_record(), f)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
