"""Leases: one job at a time per output folder, one run at a time per job's work area.

The holder writes a small JSON file (run id, host, pid, heartbeat; for an output folder also
what it converts) and refreshes the heartbeat while it works. A lease is stale when its
heartbeat is older than `STALE_SECONDS`, or when it names a process on this host that no
longer exists (a run killed with SIGKILL); a stale lease is taken over, a live one refused.

- `destination_lease`: `OUT/.zerosafe-lease.json`, taken before the output folder is looked
  at (or cleared by `--overwrite`) and held until publish, so two different jobs (another
  dtype, shard size or source) never write one folder at once.
- `work_lease`: `WORK/lease.json`, so two runs of one job never share a work area (which can
  live outside the output folder with `--work-dir`).
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
from collections.abc import Callable, Iterator
from typing import Any

from zerosafe.errors import ConversionError
from zerosafe.io.storage import Storage, is_local, join_url, local_path

__all__ = [
    "DESTINATION_LEASE_NAME",
    "LeaseHeldError",
    "STALE_SECONDS",
    "destination_lease",
    "destination_lease_url",
    "lease_is_stale",
    "pid_alive",
    "work_lease",
]

log = logging.getLogger(__name__)

DESTINATION_LEASE_NAME = ".zerosafe-lease.json"
STALE_SECONDS = 90
HEARTBEAT_SECONDS = 15


class LeaseHeldError(ConversionError):
    """Another live run holds the work area."""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lease_is_stale(lease: dict[str, Any], now: float) -> bool:
    """A lease whose heartbeat is older than `STALE_SECONDS`, or whose holder on this host is
    gone (killed with SIGKILL), holds nothing."""
    if now - float(lease.get("heartbeat", 0) or 0) > STALE_SECONDS:
        return True
    if lease.get("host") != socket.gethostname():
        return False
    try:
        return not pid_alive(int(lease.get("pid", -1)))
    except (TypeError, ValueError):
        return False  # an unreadable pid: trust the heartbeat


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
def _held(
    storage: Storage,
    url: str,
    *,
    refuse: Callable[[dict[str, Any], float], str],
    info: dict[str, Any] | None = None,
    clean: list[str] | None = None,
) -> Iterator[str]:
    """Hold the lease file `url` for the duration of the block; yields the run id."""
    run_id = uuid.uuid4().hex
    now = time.time()
    if storage.exists(url):
        try:
            held = json.loads(storage.read_bytes(url))
        except (ValueError, OSError):
            held = {}
        if not isinstance(held, dict):
            held = {}
        if held and not lease_is_stale(held, now):
            raise LeaseHeldError(refuse(held, now))
        if held:
            log.info("taking over the stale lease of run %s", held.get("run_id"))
    stop = threading.Event()

    def write() -> None:
        body = {
            **(info or {}),
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

    storage.makedirs(url.rsplit("/", 1)[0])
    write()
    # Two runs that both saw no lease: the later writer wins; the other notices and stops.
    time.sleep(0.05)
    current = json.loads(storage.read_bytes(url))
    if current.get("run_id") != run_id:
        raise LeaseHeldError(refuse(current, time.time()))
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


def _holder(held: dict[str, Any], now: float) -> str:
    return (
        f"pid {held.get('pid')} on {held.get('host')}, heartbeat "
        f"{now - float(held.get('heartbeat', 0) or 0):.0f} s ago"
    )


@contextlib.contextmanager
def work_lease(storage: Storage, work_url: str, *, clean: list[str] | None = None) -> Iterator[str]:
    """Hold the lease on `work_url` for the duration of the block; yields the run id.

    Args:
        clean: Folders whose leftover temporary files are removed once the lease is held.

    Raises:
        LeaseHeldError: If a live run holds it.
    """
    url = join_url(work_url, "lease.json")

    def refuse(held: dict[str, Any], now: float) -> str:
        return (
            f"{work_url}: another run of this job ({_holder(held, now)}) is working here. Wait "
            f"for it to finish, or, if it is gone, delete {url} and run again."
        )

    with _held(storage, url, refuse=refuse, clean=clean) as run_id:
        yield run_id


def destination_lease_url(out_url: str) -> str:
    """The lease file of an output folder, held by whichever job converts into it."""
    return join_url(out_url, DESTINATION_LEASE_NAME)


@contextlib.contextmanager
def destination_lease(
    storage: Storage, out_url: str, *, job: str, clean: list[str] | None = None
) -> Iterator[str]:
    """Hold the output folder for one job at a time, whatever its options.

    Two different jobs (another dtype, shard size or source) into one folder would mix their
    files under one completion marker, or delete each other's; the second is refused.

    Args:
        job: What the holder converts, shown to a refused run.
        clean: Folders whose leftover temporary files are removed once the lease is held.

    Raises:
        LeaseHeldError: If a live run holds the output folder.
    """
    url = destination_lease_url(out_url)

    def refuse(held: dict[str, Any], now: float) -> str:
        what = held.get("job") or "another job"
        return (
            f"{out_url}: another conversion into this output folder is running ({what}; "
            f"{_holder(held, now)}). Wait for it to finish or choose another output folder; "
            f"if that run is gone, delete {url} and run again."
        )

    storage.ensure_folder(out_url)
    with _held(storage, url, refuse=refuse, info={"job": job}, clean=clean) as run_id:
        yield run_id
