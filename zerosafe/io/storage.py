"""One facade over local paths, NFS mounts and fsspec URLs (`s3://...`, `memory://...`).

The engine reads sources through `ByteSource` (ranged reads, nothing else) and writes through
`Sink` (sequential writes that become visible only on `commit`). Local paths take a fast path
(`os.pread` into caller buffers, temp file + fsync + rename); every other URL goes through
fsspec. On S3 (`zerosafe.io.s3`) large reads become concurrent ranged GETs straight into the
caller's buffer, and writes stream as multipart uploads in bounded parts, visible only once
complete; permanent failures (403, missing bucket or key) become errors that name the URL and
the likely fix, while transient ones propagate for the task to retry.
URLs stay `str` throughout: `pathlib.Path` would collapse the `//` of `s3://`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import posixpath
import secrets
import shutil
import stat
import threading
from collections.abc import Iterator
from typing import Any

from zerosafe.errors import CheckpointFormatError, StorageError
from zerosafe.io.contracts import ByteSource, FileIdentity, IOCounter, PositionalSink, Sink
from zerosafe.io.s3 import (
    S3MultipartSink,
    TransferSettings,
    fsspec_options,
    redact_options,
    split_transfer_options,
    translated_errors,
)
from zerosafe.io.whole_file import (
    JSON_MAX_BYTES,
    SMALL_FILE_FIX,
    TAG_NAME_MAX_BYTES,
    file_kind,
    read_local,
)

__all__ = [
    "JSON_MAX_BYTES",
    "TAG_NAME_MAX_BYTES",
    "ByteSource",
    "FileIdentity",
    "IOCounter",
    "PositionalSink",
    "Sink",
    "Storage",
    "file_kind",
    "is_local",
    "join_url",
    "local_path",
    "normalize_url",
]

log = logging.getLogger(__name__)


def is_local(url: str) -> bool:
    """Whether `url` names a file on a local or NFS-mounted filesystem."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The OS path of a local URL (`file:///x` or `/x`)."""
    return url[len("file://") :] if url.startswith("file://") else url


def normalize_url(url: str) -> str:
    """One spelling per location, before a URL enters any identity (job key, lease, manifest).

    A local path or `file://` URL becomes the absolute, symlink-resolved path, so `ckpt`,
    `./ckpt`, `/abs/ckpt` and `file:///abs/ckpt` are one job. Other URLs only lose a trailing
    `/`.
    """
    if is_local(url):
        path = local_path(url)
        return os.path.realpath(os.path.expanduser(path)) if path else path
    return url.rstrip("/") if not url.endswith("://") else url


def join_url(base: str, *parts: str) -> str:
    """Join path parts onto a URL or path with `/`, keeping the scheme's `//` intact."""
    out = base.rstrip("/") if len(base) > 1 else base
    for part in parts:
        out = posixpath.join(out, part.strip("/")) if out else part
    return out


def _short_read(url: str, offset: int, want: int, got: int, size: int) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{url}: wanted {want} bytes at offset {offset} but the file ends after {got} "
        f"(file size {size}); the file is truncated or was still being written. "
        "Copy it again from the training run's storage."
    )


class LocalSource:
    """A local (or NFS) file read with `os.pread`, which releases the GIL and is thread-safe."""

    def __init__(self, url: str, counter: IOCounter | None = None) -> None:
        self.url = url
        self._counter = counter
        path = local_path(url)
        try:
            # O_NONBLOCK: opening a FIFO would otherwise wait for a writer; it changes
            # nothing for a regular file, the only kind read past the check below.
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        except FileNotFoundError as e:
            raise CheckpointFormatError(f"{url}: file not found") from e
        except OSError as e:
            raise StorageError(f"{url}: cannot open for reading: {e.strerror}") from e
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self._fd)
            self._fd = -1
            raise CheckpointFormatError(
                f"{url}: expected a regular file, found a {file_kind(st.st_mode)}, which has no "
                "fixed size to read; replace it with the file itself"
            )
        self.size_bytes = st.st_size

    def read_range(self, start: int, end: int) -> bytes:
        want = end - start
        data = os.pread(self._fd, want, start)
        while len(data) < want:  # pread may return short on NFS; loop until EOF
            more = os.pread(self._fd, want - len(data), start + len(data))
            if not more:
                raise _short_read(self.url, start, want, len(data), self.size_bytes)
            data += more
        if self._counter is not None:
            self._counter.add_read(want, self.url)
        return data

    def readinto_at(self, offset: int, buf: memoryview) -> None:
        want = len(buf)
        done = 0
        while done < want:
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n == 0:
                raise _short_read(self.url, offset, want, done, self.size_bytes)
            done += n
        if self._counter is not None:
            self._counter.add_read(want, self.url)

    def prefetch(self, offset: int, nbytes: int) -> None:
        """Have the kernel start reading `[offset, offset + nbytes)` into the page cache, and
        return at once (`POSIX_FADV_WILLNEED`): a reader that works a block at a time keeps the
        disk busy while it computes."""
        if _FADV_WILLNEED is not None and nbytes > 0:
            with contextlib.suppress(OSError):
                os.posix_fadvise(self._fd, offset, nbytes, _FADV_WILLNEED)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


_FADV_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)


class FsspecSource:
    """A file behind any fsspec filesystem, read with ranged requests.

    On an async filesystem (s3fs) a read larger than `range_bytes` is split into ranged GETs
    of that size, up to `max_requests` at once, each copied into the caller's buffer as it
    arrives; smaller reads are one ranged GET of exactly the bytes asked for.
    """

    def __init__(
        self,
        fs: Any,
        url: str,
        path: str,
        size_bytes: int,
        counter: IOCounter | None,
        settings: TransferSettings | None = None,
    ) -> None:
        self.url = url
        self.size_bytes = size_bytes
        self._fs = fs
        self._path = path
        self._counter = counter
        self._settings = settings or TransferSettings()
        self.transfer = self._settings
        """Its storage's transfer settings (the copy pipeline sizes coalesced reads by them)."""
        self._async = bool(getattr(fs, "async_impl", False)) and hasattr(fs, "_cat_file")

    def _check_bounds(self, start: int, end: int) -> None:
        if end > self.size_bytes:
            raise _short_read(
                self.url, start, end - start, max(0, self.size_bytes - start), self.size_bytes
            )

    def read_range(self, start: int, end: int) -> bytes:
        self._check_bounds(start, end)
        want = end - start
        if want <= 0:
            return b""
        if self._async and want > self._settings.range_bytes:
            buf = bytearray(want)
            self.readinto_at(start, memoryview(buf))
            return bytes(buf)
        with translated_errors(self.url, "read"):
            data = self._fs.cat_file(self._path, start=start, end=end)
        if len(data) != want:
            raise _short_read(self.url, start, want, len(data), self.size_bytes)
        if self._counter is not None:
            self._counter.add_read(want, self.url)
        return bytes(data)

    def readinto_at(self, offset: int, buf: memoryview) -> None:
        want = len(buf)
        self._check_bounds(offset, offset + want)
        if not self._async or want <= self._settings.range_bytes:
            buf[:] = self.read_range(offset, offset + want)
            return
        from fsspec.asyn import sync

        with translated_errors(self.url, "read"):
            sync(self._fs.loop, self._gather_into, offset, buf)
        if self._counter is not None:
            self._counter.add_read(want, self.url)

    async def _gather_into(self, offset: int, buf: memoryview) -> None:
        import asyncio

        step = self._settings.range_bytes
        gate = asyncio.Semaphore(self._settings.max_requests)

        async def one(lo: int, hi: int) -> None:
            async with gate:
                data = await self._fs._cat_file(self._path, start=offset + lo, end=offset + hi)
            if len(data) != hi - lo:
                raise _short_read(self.url, offset + lo, hi - lo, len(data), self.size_bytes)
            buf[lo:hi] = data

        spans = [(lo, min(lo + step, len(buf))) for lo in range(0, len(buf), step)]
        # Wait for every request, failed or not, before returning: the caller may reuse `buf`.
        results = await asyncio.gather(*(one(lo, hi) for lo, hi in spans), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def close(self) -> None:
        pass


_WRITEBACK_BYTES = 64 * 2**20
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback, do not wait


def _load_sync_file_range() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        func = libc.sync_file_range
    except (OSError, AttributeError):
        return None  # not Linux/glibc: the kernel writes back on its own schedule
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return func


_sync_file_range = _load_sync_file_range()


class LocalSink:
    """Writes to a hidden temporary file beside the target, fsyncs, then renames into place.

    Every 64 MiB it asks the kernel to start writing back what it has written, without
    waiting: left alone, the kernel lets about half a gigabyte get dirty and then throttles
    the writer (measured here at 0.4 GB/s), and the fsync at commit has it all to do.
    """

    def __init__(
        self, url: str, counter: IOCounter | None = None, *, max_mode: int | None = None
    ) -> None:
        self.url = url
        self.bytes_written = 0
        self._counter = counter
        self._path = local_path(url)
        folder, name = os.path.split(self._path)
        os.makedirs(folder or ".", exist_ok=True)
        self._tmp_path = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.partial")
        # Created with the narrower mode at once (the umask narrows it further), so the file
        # is never readable by more users than `max_mode` allows, not even briefly.
        mode = 0o666 if max_mode is None else 0o666 & max_mode
        try:
            fd = os.open(self._tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            self._file = open(fd, "wb", buffering=0)  # noqa: SIM115
        except OSError as e:
            raise StorageError(f"{url}: cannot create '{self._tmp_path}': {e.strerror}") from e
        self._done = False
        self._flushed = 0
        self._count_lock = threading.Lock()

    def write(self, data: bytes | memoryview) -> None:
        self._write(data)
        self._start_writeback(whole_file=False)

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """Write `data` at `offset` (`os.pwrite`, so several threads may each fill their own
        range of the file: a merge's parallel streams); `write` is still the sequential
        append, and the file is whole only once every range is written."""
        view = memoryview(data).cast("B")
        fd = self._file.fileno()
        try:
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
                with self._count_lock:
                    self.bytes_written += n
                if self._counter is not None:
                    self._counter.add_written(n)
        except OSError as e:  # not aborted here: other threads may be writing to the file
            raise self._write_error(e) from e
        self._start_writeback(whole_file=True)

    def _start_writeback(self, *, whole_file: bool) -> None:
        """Once 64 MiB more are written, ask the kernel to start writing them back, without
        waiting: the range appended since the last time, or, where threads fill ranges of the
        file (`write_at`), every range written so far (0, 0: the whole file). Without it a
        merge in streams left its commit the whole file to write back (0.37 s for 1 GB on this
        disk, against under 0.05 s once started early)."""
        if _sync_file_range is None:
            return
        with self._count_lock:
            start, end = self._flushed, self.bytes_written
            if end - start < _WRITEBACK_BYTES:
                return
            self._flushed = end
        offset, length = (0, 0) if whole_file else (start, end - start)
        _sync_file_range(self._file.fileno(), offset, length, _SYNC_FILE_RANGE_WRITE)

    def _write_error(self, e: OSError) -> StorageError:
        if e.errno == errno.ENOSPC:
            return StorageError(
                f"{self.url}: no space left on device after writing {self.bytes_written} bytes; "
                "free space there (or choose another output) and run the same command again"
            )
        return StorageError(f"{self.url}: write failed: {e.strerror}")

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                n = self._file.write(view)
                assert n is not None
                view = view[n:]
                self.bytes_written += n
                if self._counter is not None:
                    self._counter.add_written(n)
        except OSError as e:
            self.abort()
            raise self._write_error(e) from e

    def commit(self) -> None:
        assert not self._done, "sink already closed"
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp_path, self._path)
            _fsync_dir(os.path.dirname(self._path) or ".")
        except OSError as e:
            self.abort()
            raise StorageError(f"{self.url}: could not complete the write: {e.strerror}") from e
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp_path)


class FsspecSink:
    """Writes through fsspec's file objects (object stores other than S3, `memory://`)."""

    def __init__(self, fs: Any, url: str, path: str, counter: IOCounter | None) -> None:
        self.url = url
        self.bytes_written = 0
        self._fs = fs
        self._counter = counter
        parent = posixpath.dirname(path)
        if parent:
            with contextlib.suppress(Exception):
                fs.makedirs(parent, exist_ok=True)
        self._file = fs.open(path, "wb")
        self._done = False

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        n = memoryview(data).nbytes
        self.bytes_written += n
        if self._counter is not None:
            self._counter.add_written(n)

    def commit(self) -> None:
        self._file.close()
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        discard = getattr(self._file, "discard", None)
        if discard is not None:  # a file object that can drop its upload: no part lingers
            with contextlib.suppress(Exception):
                discard()
        else:
            with contextlib.suppress(Exception):
                self._file.close()


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Storage:
    """Opens sources and sinks for URLs, with one `IOCounter` for everything it opens.

    Args:
        storage_options: For non-local URLs: fsspec options (`endpoint_url`, `profile`,
            `region`, `anon`, ...; see `zerosafe.io.s3.fsspec_options`) plus zerosafe's transfer
            options `part_size`, `range_size` and `max_requests` (`zerosafe.io.s3.TransferSettings`).
        counter: Counts bytes read and written; a fresh one if not given.
    """

    def __init__(
        self, storage_options: dict[str, Any] | None = None, counter: IOCounter | None = None
    ) -> None:
        self.storage_options = dict(storage_options or {})
        self._fsspec_options, self.transfer = split_transfer_options(self.storage_options)
        self.counter = counter if counter is not None else IOCounter()
        self._fs_cache: dict[str, Any] = {}
        self._buckets_seen: set[str] = set()

    def __repr__(self) -> str:
        return f"Storage({redact_options(self.storage_options)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its options (for a worker process: `zerosafe.run.workers`); the copy
        counts its own bytes from zero."""
        return (Storage, (self.storage_options,))

    def _fs(self, url: str) -> tuple[Any, str]:
        import fsspec

        protocol = url.split("://", 1)[0]
        fs = self._fs_cache.get(protocol)
        if fs is None:
            fs = fsspec.filesystem(protocol, **fsspec_options(protocol, self._fsspec_options))
            self._fs_cache[protocol] = fs
        return fs, fs._strip_protocol(url)

    def filesystem(self, url: str) -> tuple[Any, str]:
        """The fsspec filesystem behind a non-local `url`, and the path within it."""
        return self._fs(url)

    def canonical_url(self, url: str) -> str:
        """One spelling per location, for comparing two of them: a local path absolute with
        links resolved (`normalize_url`), a URL as its filesystem names it (`s3a://b//k/`
        and `s3://b/k` are one key)."""
        if is_local(url):
            return normalize_url(url)
        fs, path = self._fs(url)
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        return f"{protocol}://{posixpath.normpath(path)}"

    def _require_bucket(self, fs: Any, url: str) -> None:
        """On S3 a missing bucket looks like an empty folder or a missing file: say so."""
        if not _is_s3(url):
            return
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        if bucket in self._buckets_seen:
            return
        try:
            fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError as e:
            raise StorageError(
                f"{url}: bucket '{bucket}' does not exist. Check the bucket name in the URL, "
                "and the `endpoint_url` and `region` storage options (or AWS_ENDPOINT_URL) if "
                "the bucket lives on another endpoint."
            ) from e
        except PermissionError:
            return  # HeadBucket may be forbidden where reads are allowed: not conclusive
        self._buckets_seen.add(bucket)

    # -- reading ------------------------------------------------------------------------------

    def open_source(self, url: str) -> ByteSource:
        """Open `url` for ranged reads."""
        if is_local(url):
            return LocalSource(url, self.counter)
        fs, path = self._fs(url)
        try:
            with translated_errors(url, "open"):
                info = fs.info(path)
        except CheckpointFormatError as e:  # the key is missing: is the bucket?
            self._require_bucket(fs, url)
            raise CheckpointFormatError(
                f"{url}: file not found. Check the URL, and that the copy or upload of the "
                "checkpoint finished."
            ) from e.__cause__
        if info.get("type") == "directory":
            raise CheckpointFormatError(f"{url}: is a folder, expected a file")
        return FsspecSource(fs, url, path, int(info["size"]), self.counter, self.transfer)

    def read_bytes(self, url: str) -> bytes:
        """Read a whole file of any size (a plan's tables, a small torch pickle); a control file
        a reader opens first goes through `read_small` instead, which caps its size.

        Raises:
            FileNotFoundError: If a local file is missing.
            CheckpointFormatError: If it is not a regular file (a FIFO, device, socket, folder).
        """
        return self._read_whole(url, None, what="a file", fix=SMALL_FILE_FIX)

    def read_small(
        self, url: str, *, limit_bytes: int, what: str, fix: str = SMALL_FILE_FIX
    ) -> bytes:
        """Read a whole small control file (DeepSpeed's `latest`, DCP's `.metadata`, a JSON
        config), checked before it is opened: a regular file of at most `limit_bytes` bytes.

        A local path is `stat`ed first (following links), so a FIFO, device, socket or folder
        is refused without being opened; it is then opened with `O_NONBLOCK` (a FIFO swapped in
        meanwhile cannot block the open) and checked again, and at most `limit_bytes + 1`
        bytes are read (a file that grew meanwhile is refused, not read whole). An fsspec URL
        is checked by its `info()` type and size, and read with one ranged request.

        Args:
            url: The file.
            limit_bytes: The most bytes the file may hold, fitted to what it holds
                (`TAG_NAME_MAX_BYTES`, `JSON_MAX_BYTES`, ...).
            what: What the file should be, for the message ("DeepSpeed's `latest` file").
            fix: What the user should do, ending the message.

        Raises:
            FileNotFoundError: If a local file is missing (the caller knows what that means).
            CheckpointFormatError: If it is not a regular file or holds more than
                `limit_bytes` bytes: one line naming the file, what was expected, what was
                found and `fix`.
            StorageError: If it cannot be read for another reason (permissions).
        """
        return self._read_whole(url, limit_bytes, what=what, fix=fix)

    def _read_whole(self, url: str, limit_bytes: int | None, *, what: str, fix: str) -> bytes:
        def refusal(found: str) -> CheckpointFormatError:
            most = "" if limit_bytes is None else f" of at most {limit_bytes} bytes"
            return CheckpointFormatError(
                f"{url}: expected {what}, a regular file{most}, found {found}; {fix}"
            )

        if is_local(url):
            data = read_local(local_path(url), url, limit_bytes, refusal)
        else:
            fs, path = self._fs(url)
            end = None
            if limit_bytes is not None:  # object stores hold no FIFOs: only the size matters
                with translated_errors(url, "stat"):
                    info = fs.info(path)
                if info.get("type") != "file":
                    raise refusal(f"a {info.get('type') or 'special entry'}")
                if int(info.get("size") or 0) > limit_bytes:
                    raise refusal(f"{int(info['size'])} bytes")
                end = limit_bytes + 1
            with translated_errors(url, "read"):
                data = bytes(fs.cat_file(path, start=0, end=end))
        if limit_bytes is not None and len(data) > limit_bytes:
            raise refusal(f"more than {limit_bytes} bytes (it grew while read)")
        self.counter.add_read(len(data), url)
        return data

    def identity(self, url: str) -> FileIdentity:
        """Size and version (mtime or ETag) of a file, without reading it."""
        if is_local(url):
            st = os.stat(local_path(url))
            return FileIdentity(url=url, size_bytes=st.st_size, version=str(st.st_mtime_ns))
        fs, path = self._fs(url)
        with translated_errors(url, "stat"):
            info = fs.info(path)
        version = (
            info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
        )
        return FileIdentity(url=url, size_bytes=int(info["size"]), version=str(version))

    def exists(self, url: str) -> bool:
        if is_local(url):
            return os.path.exists(local_path(url))
        fs, path = self._fs(url)
        with translated_errors(url, "stat"):
            found = bool(fs.exists(path))
        if not found:
            self._require_bucket(fs, url)
        return found

    def isdir(self, url: str) -> bool:
        if is_local(url):
            return os.path.isdir(local_path(url))
        fs, path = self._fs(url)
        with translated_errors(url, "list"):
            found = bool(fs.isdir(path))
        if not found:
            self._require_bucket(fs, url)
        return found

    def listdir(self, url: str) -> list[str]:
        """Names (not paths) of the entries in a folder or under a prefix; [] if it is absent."""
        if is_local(url):
            try:
                return sorted(os.listdir(local_path(url)))
            except FileNotFoundError:
                return []
        fs, path = self._fs(url)
        try:
            with translated_errors(url, "list"):
                entries = fs.ls(path, detail=False, refresh=True)
        except (FileNotFoundError, CheckpointFormatError):
            entries = []
        if not entries:
            self._require_bucket(fs, url)
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    # -- writing ------------------------------------------------------------------------------

    def open_sink(self, url: str, *, max_mode: int | None = None) -> Sink:
        """Open `url` for a sequential write that is invisible until `commit`.

        Args:
            url: Where the file goes.
            max_mode: Local files: permission bits the file may have at most (a copy of a
                0600 file passes 0o600); object stores have no modes and ignore it.
        """
        if is_local(url):
            return LocalSink(url, self.counter, max_mode=max_mode)
        fs, path = self._fs(url)
        if _is_s3(url):
            return S3MultipartSink(fs, url, path, self.counter, self.transfer)
        return FsspecSink(fs, url, path, self.counter)

    def write_bytes(self, url: str, data: bytes) -> None:
        """Write a small file atomically."""
        sink = self.open_sink(url)
        try:
            sink.write(data)
            sink.commit()
        except BaseException:
            sink.abort()
            raise

    def ensure_folder(self, url: str) -> None:
        """Make sure `url` is a folder this process can write into (created if missing).

        Raises:
            StorageError: If it is a file, under a file, or not writable (permissions, a
                read-only filesystem), naming the path and the reason.
        """
        if not is_local(url):
            return  # object stores have no folders; permissions show on the first write
        path = local_path(url)
        if os.path.exists(path) and not os.path.isdir(path):
            raise StorageError(
                f"{url}: expected an output folder, found a file. Choose a folder path (it is "
                "created if missing)."
            )
        probe = os.path.join(path, f".zerosafe-probe-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.makedirs(path, exist_ok=True)
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as e:
            reason = e.strerror or str(e)
            raise StorageError(
                f"{url}: expected a folder this user can write, but writing there failed: "
                f"{reason}. Choose another output folder, or fix its permissions (or mount it "
                "read-write)."
            ) from e

    def rename(self, src_url: str, dst_url: str) -> None:
        """Move a finished file to its final name (atomic locally; a server-side copy on
        object stores, where the object appears whole or not at all)."""
        if is_local(src_url) and is_local(dst_url):
            dst = local_path(dst_url)
            try:
                os.replace(local_path(src_url), dst)
                _fsync_dir(os.path.dirname(dst) or ".")
            except OSError as e:
                raise StorageError(
                    f"{dst_url}: could not move {src_url} into place: {e.strerror}"
                ) from e
            return
        fs, src = self._fs(src_url)
        _, dst = self._fs(dst_url)
        with translated_errors(dst_url, "write"):
            fs.mv(src, dst)

    def makedirs(self, url: str) -> None:
        if is_local(url):
            os.makedirs(local_path(url), exist_ok=True)
        # object stores have no folders to make

    def remove(self, url: str) -> None:
        """Remove a file if it exists."""
        if is_local(url):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(local_path(url))
            return
        fs, path = self._fs(url)
        with translated_errors(url, "remove"), contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)

    def remove_tree(self, url: str) -> None:
        """Remove a folder or prefix and everything under it, if it exists."""
        if is_local(url):
            shutil.rmtree(local_path(url), ignore_errors=True)
            return
        fs, path = self._fs(url)
        with translated_errors(url, "remove"), contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)

    def free_bytes(self, url: str) -> int | None:
        """Free space where `url` would be written, or None where it cannot be known (S3)."""
        if not is_local(url):
            return None
        path = os.path.abspath(local_path(url))
        while not os.path.exists(path):
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        return shutil.disk_usage(path).free

    @contextlib.contextmanager
    def sink(self, url: str, *, max_mode: int | None = None) -> Iterator[Sink]:
        """A sink committed when the block ends normally and aborted on any exception
        (`max_mode` as in `open_sink`)."""
        sink = self.open_sink(url, max_mode=max_mode)
        try:
            yield sink
        except BaseException:
            sink.abort()
            raise
        sink.commit()


def _is_s3(url: str) -> bool:
    return url.startswith(("s3://", "s3a://"))
