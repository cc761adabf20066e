"""A lease on a job's work area, so two runs of the same job never work on it at once.

The holder writes `lease.json` (run id, host, pid, heartbeat) and refreshes the heartbeat
while it works. A lease is stale when its heartbeat is older than `STALE_SECONDS`, or when it
names a process on this host that no longer exists (a run killed with SIGKILL); a stale lease
is taken over, a live one refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from zerosafe.errors import ConversionError
from zerosafe.storage import Storage, is_local, join_url, local_path

__all__ = ["LeaseHeldError", "STALE_SECONDS", "work_lease"]

log = logging.getLogger(__name__)

STALE_SECONDS = 90
HEARTBEAT_SECONDS = 15


class LeaseHeldError(ConversionError):
    """Another live run holds the work area."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_stale(lease: dict[str, Any], now: float) -> bool:
    if now - float(lease.get("heartbeat", 0)) > STALE_SECONDS:
        return True
    return lease.get("host") == socket.gethostname() and not _alive(int(lease.get("pid", -1)))


def _clean_partials(storage: Storage, folders: list[str]) -> None:
    """Remove temporary files a killed run left (they never become visible outputs)."""
    for folder in folders:
        if not is_local(folder):
            continue  # object stores: unfinished multipart uploads, see `zerosafe clean`
        for name in storage.listdir(folder):
            if name.startswith(".") and name.endswith(".partial"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(local_path(folder), name))


@contextlib.contextmanager
def work_lease(storage: Storage, work_url: str, *, clean: list[str] | None = None) -> Iterator[str]:
    """Hold the lease on `work_url` for the duration of the block; yields the run id.

    Args:
        clean: Folders whose leftover temporary files are removed once the lease is held.

    Raises:
        LeaseHeldError: If a live run holds it.
    """
    url = join_url(work_url, "lease.json")
    run_id = uuid.uuid4().hex
    now = time.time()
    if storage.exists(url):
        try:
            held = json.loads(storage.read_bytes(url))
        except (ValueError, OSError):
            held = {}
        if held and not _is_stale(held, now):
            raise LeaseHeldError(
                f"{work_url}: another run of this job (pid {held.get('pid')} on {held.get('host')}, "
                f"heartbeat {now - float(held.get('heartbeat', 0)):.0f} s ago) is working here. Wait for "
                f"it to finish, or, if it is gone, delete {url} and run again."
            )
        if held:
            log.info("taking over the stale lease of run %s", held.get("run_id"))
    stop = threading.Event()

    def write() -> None:
        body = {
            "run_id": run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "heartbeat": time.time(),
        }
        storage.write_bytes(url, json.dumps(body).encode())

    def beat() -> None:
        while not stop.wait(HEARTBEAT_SECONDS):
            with contextlib.suppress(Exception):
                write()

    storage.makedirs(work_url)
    write()
    # Two runs that both saw no lease: the later writer wins; the other notices and stops.
    time.sleep(0.05)
    if json.loads(storage.read_bytes(url)).get("run_id") != run_id:
        raise LeaseHeldError(
            f"{work_url}: another run of this job started at the same moment; it holds the work area"
        )
    _clean_partials(storage, clean or [])
    thread = threading.Thread(target=beat, name="zerosafe-lease", daemon=True)
    thread.start()
    try:
        yield run_id
    finally:
        stop.set()
        thread.join(timeout=5)
        with contextlib.suppress(Exception):
            if storage.exists(url) and json.loads(storage.read_bytes(url)).get("run_id") == run_id:
                storage.remove(url)
