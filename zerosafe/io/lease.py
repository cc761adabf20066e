"""Leases: one job at a time per output folder, one run at a time per job's work area.

The holder writes a small JSON file, a `LeaseRecord` (run id, host, pid, heartbeat; for an
output folder also what it converts) and refreshes the heartbeat while it works. A lease is stale when its
heartbeat is older than `STALE_SECONDS`, or when it names a process on this host that no
longer exists (a run killed with SIGKILL); a stale lease is taken over, a live one refused.

- `destination_lease`: `OUT/.zerosafe-lease.json`, taken before the output folder is looked
  at (or cleared by `--overwrite`) and held until publish, so two different jobs (another
  dtype, shard size or source) never write one folder at once.
- `work_lease`: `WORK/lease.json`, so two runs of one job never share a work area (which can
  live outside the output folder with `--work-dir`).

Lease writes are conditional where the store has conditional writes, so two runs never both
believe they hold one:

- S3 (and S3-compatible stores that implement conditional writes): a lease is created with
  `PUT` + `If-None-Match: *`, and taken over or refreshed with `PUT` + `If-Match: <ETag>` of
  the version read (https://docs.aws.amazon.com/AmazonS3/latest/userguide/conditional-writes.html).
  A store that answers `NotImplemented` stops the run with one line (`StorageError`); one
  that silently ignores the headers is not protected: use a store that honours them. The
  release reads the lease and deletes it if it is still this run's (a plain `DELETE`).
- Local folders (NFS included): a lease is created with `link(2)` of a finished temporary
  file, which fails where the lease exists; a take-over, a heartbeat and a release compare
  and replace under a guard file created with `O_CREAT|O_EXCL` (`lease.json.guard`).
- Other fsspec stores (no conditional write): write, wait, and read back, as before; two
  runs started within a write's latency of each other can both proceed there.

Each heartbeat replaces only the version this run wrote. Where another run took the lease
over (this run's heartbeats stalled past `STALE_SECONDS`), the heartbeat stops and
`Lease.check()`, which the drivers call before publishing, raises `LeaseLostError`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from zerosafe.errors import ConversionError, StorageError
from zerosafe.io.storage import JSON_MAX_BYTES, Storage, is_local, join_url, local_path
from zerosafe.records import Record, RecordError, json_meta

__all__ = [
    "DESTINATION_LEASE_NAME",
    "Lease",
    "LeaseHeldError",
    "LeaseLostError",
    "LeaseRecord",
    "STALE_SECONDS",
    "destination_lease",
    "destination_lease_url",
    "lease_is_stale",
    "parse_lease",
    "pid_alive",
    "work_lease",
]

log = logging.getLogger(__name__)

DESTINATION_LEASE_NAME = ".zerosafe-lease.json"
STALE_SECONDS = 90
HEARTBEAT_SECONDS = 15
_GUARD_WAIT_SECONDS = 2.0
"""How long a local writer waits for another's guard (held for a few file operations)."""


class LeaseHeldError(ConversionError):
    """Another live run holds the work area."""


class LeaseLostError(ConversionError):
    """Another run took over a lease this run held: this run must not publish."""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseRecord(Record):
    """What a lease file holds: who holds it and since when it last said so."""

    job: str | None = field(default=None, metadata=json_meta(omit_default=True))
    """What the holder converts (an output folder's lease only), shown to a refused run."""
    run_id: str | None = None
    host: str | None = None
    pid: int | None = None
    heartbeat: float | None = None
    """`time.time()` of the holder's last write."""


def parse_lease(raw: bytes) -> LeaseRecord | None:
    """The lease in a lease file's bytes; None for content that is not one (a torn write):
    such a file holds nothing."""
    try:
        return LeaseRecord.from_json(json.loads(raw))
    except (ValueError, RecordError):
        return None


def lease_is_stale(lease: LeaseRecord, now: float) -> bool:
    """A lease whose heartbeat is older than `STALE_SECONDS`, or whose holder on this host is
    gone (killed with SIGKILL), holds nothing."""
    if now - (lease.heartbeat or 0) > STALE_SECONDS:
        return True
    if lease.host != socket.gethostname():
        return False
    return not pid_alive(-1 if lease.pid is None else lease.pid)


def _clean_partials(storage: Storage, folders: list[str]) -> None:
    """Remove temporary files a killed run left (they never become visible outputs)."""
    for folder in folders:
        if not is_local(folder):
            continue  # object stores: unfinished multipart uploads, see `zerosafe clean`
        for name in storage.listdir(folder):
            if name.startswith(".") and name.endswith(".partial"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(local_path(folder), name))


class _Conflict(Exception):
    """A conditional write found another version than the one it expected."""


class _LeaseFile(Protocol):
    """One lease file, written only conditionally. A version is opaque: an ETag, or the bytes
    last read."""

    def read(self) -> tuple[LeaseRecord | None, Any] | None:
        """`(lease, version)`, None for unreadable content; None if there is no lease."""
        ...

    def create(self, data: bytes) -> Any:
        """Write `data` where no lease exists; returns its version.

        Raises:
            FileExistsError: If a lease exists.
        """
        ...

    def replace(self, data: bytes, version: Any) -> Any:
        """Replace the lease at `version` with `data`; returns the new version.

        Raises:
            _Conflict: If the lease is absent or at another version.
        """
        ...

    def remove(self, version: Any) -> None:
        """Remove the lease if it is still at `version`."""
        ...


@dataclass
class _LocalLeaseFile:
    path: str

    def read(self) -> tuple[LeaseRecord | None, Any] | None:
        try:
            raw = Storage().read_small(
                self.path,
                limit_bytes=JSON_MAX_BYTES,
                what="a zerosafe lease (JSON)",
                fix="remove it if no zerosafe run uses the folder",
            )
        except FileNotFoundError:
            return None
        return parse_lease(raw), raw

    def _finished_temp(self, data: bytes) -> str:
        folder, name = os.path.split(self.path)
        # Not `.partial`: a run holding the output removes those (`_clean_partials`).
        tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def create(self, data: bytes) -> Any:
        tmp = self._finished_temp(data)
        try:
            os.link(tmp, self.path)  # atomic, and fails where the lease exists
        finally:
            os.unlink(tmp)
        return data

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        guard = self.path + ".guard"
        deadline = time.monotonic() + _GUARD_WAIT_SECONDS
        while True:
            try:
                os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                break
            except FileExistsError:
                with contextlib.suppress(OSError):  # a writer killed while holding it
                    if time.time() - os.stat(guard).st_mtime > STALE_SECONDS:
                        os.unlink(guard)
                        continue
                if time.monotonic() > deadline:
                    raise _Conflict(f"{guard} is held") from None
                time.sleep(0.01)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(guard)

    def replace(self, data: bytes, version: Any) -> Any:
        with self._guard():
            current = self.read()
            if current is None or current[1] != version:
                raise _Conflict(self.path)
            os.replace(self._finished_temp(data), self.path)
        return data

    def remove(self, version: Any) -> None:
        with self._guard():
            current = self.read()
            if current is not None and current[1] == version:
                os.unlink(self.path)


def _s3_code(exc: BaseException) -> str | None:
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code"))
        seen = seen.__cause__
    return None


_S3_CONFLICTS = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409"}


@dataclass
class _S3LeaseFile:
    fs: Any
    path: str

    def _call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        from fsspec.asyn import sync

        bucket, key = self.path.split("/", 1)

        async def call() -> dict[str, Any]:
            response: dict[str, Any] = await self.fs._call_s3(
                method, Bucket=bucket, Key=key, **kwargs
            )
            if "Body" in response:
                async with response["Body"] as body:
                    response["Body"] = await body.read()
            return response

        try:
            result: dict[str, Any] = sync(self.fs.loop, call)
        except OSError as e:
            if _s3_code(e) == "NotImplemented" and ("IfMatch" in kwargs or "IfNoneMatch" in kwargs):
                raise StorageError(
                    f"s3://{self.path}: this store does not implement conditional writes "
                    "(`If-None-Match`/`If-Match` on PUT), which zerosafe's leases need to keep "
                    "two runs apart; use a store that does (AWS S3 does)."
                ) from e
            raise
        return result

    def read(self) -> tuple[LeaseRecord | None, Any] | None:
        try:
            response = self._call("get_object")
        except FileNotFoundError:
            return None
        return parse_lease(response["Body"]), response["ETag"]

    def create(self, data: bytes) -> Any:
        try:
            return self._call("put_object", Body=data, IfNoneMatch="*")["ETag"]
        except OSError as e:
            if _s3_code(e) in _S3_CONFLICTS:
                raise FileExistsError(errno.EEXIST, f"s3://{self.path} exists") from e
            raise

    def replace(self, data: bytes, version: Any) -> Any:
        try:
            return self._call("put_object", Body=data, IfMatch=version)["ETag"]
        except OSError as e:
            if isinstance(e, FileNotFoundError) or _s3_code(e) in _S3_CONFLICTS:
                raise _Conflict(f"s3://{self.path}") from e
            raise

    def remove(self, version: Any) -> None:
        current = self.read()
        if current is not None and current[1] == version:
            self._call("delete_object")  # TODO: `If-Match` where the store takes it on DELETE


@dataclass
class _PlainLeaseFile:
    """A store without conditional writes: write, wait, read back (see the module docstring)."""

    storage: Storage
    url: str

    def read(self) -> tuple[LeaseRecord | None, Any] | None:
        if not self.storage.exists(self.url):
            return None
        raw = self.storage.read_bytes(self.url)
        return parse_lease(raw), raw

    def _write_and_confirm(self, data: bytes) -> Any:
        self.storage.write_bytes(self.url, data)
        # Two runs that both saw no lease: the later writer wins; the other notices here.
        time.sleep(0.05)
        current = self.read()
        if current is None or current[1] != data:
            raise _Conflict(self.url)
        return data

    def create(self, data: bytes) -> Any:
        if self.storage.exists(self.url):
            raise FileExistsError(errno.EEXIST, f"{self.url} exists")
        try:
            return self._write_and_confirm(data)
        except _Conflict as e:
            raise FileExistsError(errno.EEXIST, f"{self.url} exists") from e

    def replace(self, data: bytes, version: Any) -> Any:
        current = self.read()
        if current is None or current[1] != version:
            raise _Conflict(self.url)
        return self._write_and_confirm(data)

    def remove(self, version: Any) -> None:
        current = self.read()
        if current is not None and current[1] == version:
            self.storage.remove(self.url)


def _lease_file(storage: Storage, url: str) -> _LeaseFile:
    if is_local(url):
        return _LocalLeaseFile(local_path(url))
    if url.startswith(("s3://", "s3a://")):
        fs, path = storage.filesystem(url)
        return _S3LeaseFile(fs, path)
    return _PlainLeaseFile(storage, url)


@dataclass
class Lease:
    """A lease this run holds for the duration of a `with` block (`work_lease`,
    `destination_lease`)."""

    url: str
    run_id: str
    lost: str | None = None
    """Why the lease is no longer this run's (set by the heartbeat, or `check`), else None."""
    _file: _LeaseFile | None = field(default=None, repr=False)

    def check(self) -> None:
        """Re-read the lease now; call before publishing.

        Raises:
            LeaseLostError: If another run took it over (or it was removed).
        """
        if self.lost is None and self._file is not None:
            current = self._file.read()
            if current is None or current[0] is None or current[0].run_id != self.run_id:
                self._lose(current[0] if current else None)
        if self.lost is not None:
            raise LeaseLostError(self.lost)

    def _lose(self, held: LeaseRecord | None) -> None:
        who = (
            f"run {held.run_id}, {_holder(held, time.time())}"
            if held
            else "the lease file was removed"
        )
        self.lost = (
            f"{self.url}: another run took over this run's lease ({who}), so this run stopped "
            "before publishing; were its heartbeats stalled (a paused machine, an unreachable "
            f"store) for over {STALE_SECONDS} s? Let the other run finish, then run the "
            "command again."
        )


@contextlib.contextmanager
def _held(
    storage: Storage,
    url: str,
    *,
    refuse: Callable[[LeaseRecord, float], str],
    job: str | None = None,
    clean: list[str] | None = None,
) -> Iterator[Lease]:
    """Hold the lease file `url` for the duration of the block."""
    run_id = uuid.uuid4().hex
    lease_file = _lease_file(storage, url)

    def body() -> bytes:
        held = LeaseRecord(
            job=job, run_id=run_id, host=socket.gethostname(), pid=os.getpid(),
            heartbeat=time.time(),
        )  # fmt: skip
        return json.dumps(held.to_json()).encode()

    storage.makedirs(url.rsplit("/", 1)[0])
    version = _take(lease_file, body(), refuse)
    lease = Lease(url=url, run_id=run_id, _file=lease_file)
    stop = threading.Event()

    def beat() -> None:
        nonlocal version
        while not stop.wait(HEARTBEAT_SECONDS):
            try:
                version = lease_file.replace(body(), version)
            except _Conflict:
                current = lease_file.read()
                if current is not None and current[0] is not None and current[0].run_id == run_id:
                    version = current[1]  # our own write, read back differently: go on
                    continue
                lease._lose(current[0] if current else None)
                log.warning("%s", lease.lost)
                return
            except Exception as e:  # a storage hiccup: the next beat tries again
                log.debug("lease heartbeat of %s failed: %s", url, e)

    _clean_partials(storage, clean or [])
    thread = threading.Thread(target=beat, name="zerosafe-lease", daemon=True)
    thread.start()
    try:
        yield lease
    finally:
        stop.set()
        thread.join(timeout=5)
        if lease.lost is None:
            with contextlib.suppress(Exception):
                lease_file.remove(version)


def _take(lease_file: _LeaseFile, data: bytes, refuse: Callable[[LeaseRecord, float], str]) -> Any:
    """Create the lease, or take over a stale one; returns the version written.

    Raises:
        LeaseHeldError: If a live run holds it, or another run took it first.
    """
    for _ in range(2):  # a lease removed between the create and the read: create again
        try:
            return lease_file.create(data)
        except FileExistsError:
            current = lease_file.read()
        if current is not None:
            break
    else:
        raise LeaseHeldError(refuse(LeaseRecord(), time.time()))
    held, version = current
    if held is not None and not lease_is_stale(held, time.time()):
        raise LeaseHeldError(refuse(held, time.time()))
    if held is not None:
        log.info("taking over the stale lease of run %s", held.run_id)
    try:
        return lease_file.replace(data, version)
    except _Conflict:  # another run took it over first
        latest = lease_file.read()
        held = latest[0] if latest else None
        raise LeaseHeldError(refuse(held or LeaseRecord(), time.time())) from None


def _holder(held: LeaseRecord, now: float) -> str:
    return f"pid {held.pid} on {held.host}, heartbeat {now - (held.heartbeat or 0):.0f} s ago"


@contextlib.contextmanager
def work_lease(
    storage: Storage, work_url: str, *, clean: list[str] | None = None
) -> Iterator[Lease]:
    """Hold the lease on `work_url` for the duration of the block; yields the `Lease`.

    Args:
        clean: Folders whose leftover temporary files are removed once the lease is held.

    Raises:
        LeaseHeldError: If a live run holds it.
    """
    url = join_url(work_url, "lease.json")

    def refuse(held: LeaseRecord, now: float) -> str:
        return (
            f"{work_url}: another run of this job ({_holder(held, now)}) is working here. Wait "
            f"for it to finish, or, if it is gone, delete {url} and run again."
        )

    with _held(storage, url, refuse=refuse, clean=clean) as lease:
        yield lease


def destination_lease_url(out_url: str) -> str:
    """The lease file of an output folder, held by whichever job converts into it."""
    return join_url(out_url, DESTINATION_LEASE_NAME)


@contextlib.contextmanager
def destination_lease(
    storage: Storage, out_url: str, *, job: str, clean: list[str] | None = None
) -> Iterator[Lease]:
    """Hold the output folder for one job at a time, whatever its options; yields the
    `Lease`.

    Two different jobs (another dtype, shard size or source) into one folder would mix their
    files under one completion marker, or delete each other's; the second is refused.

    Args:
        job: What the holder converts, shown to a refused run.
        clean: Folders whose leftover temporary files are removed once the lease is held.

    Raises:
        LeaseHeldError: If a live run holds the output folder.
    """
    url = destination_lease_url(out_url)

    def refuse(held: LeaseRecord, now: float) -> str:
        what = held.job or "another job"
        return (
            f"{out_url}: another conversion into this output folder is running ({what}; "
            f"{_holder(held, now)}). Wait for it to finish or choose another output folder; "
            f"if that run is gone, delete {url} and run again."
        )

    storage.ensure_folder(out_url)
    with _held(storage, url, refuse=refuse, job=job, clean=clean) as lease:
        yield lease
