"""Whole-file reads of local files, checked before they are opened: the small control files
every reader opens first (DeepSpeed's `latest`, DCP's `.metadata`, JSON configs) must be
regular files within a cap fitted to what they hold (`zerosafe.io.storage.Storage.read_small`),
so a FIFO never hangs a command and a link to `/dev/zero` never fills its memory.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from zerosafe.errors import CheckpointFormatError, StorageError

__all__ = [
    "JSON_MAX_BYTES",
    "READ_STEP_BYTES",
    "SMALL_FILE_FIX",
    "TAG_NAME_MAX_BYTES",
    "file_kind",
    "read_local",
]

TAG_NAME_MAX_BYTES = 4096
"""Cap of `Storage.read_small` for a file that holds one tag or folder name (DeepSpeed's
`latest`, `latest_universal`): a name is at most 255 bytes on every filesystem."""

JSON_MAX_BYTES = 16 * 2**20
"""Cap of `Storage.read_small` for a JSON config or record (`fsdp_config.json`,
`adapter_config.json`, markers, leases): the real ones are a few KiB; 16 MiB leaves room for
any hand-edited one while keeping a wrong file (a weight file renamed, a link to a device) from
being read whole into memory."""

SMALL_FILE_FIX = "replace it with the file the save wrote (copy it again from where it was saved)"


def file_kind(mode: int) -> str:
    """What a file of `st_mode` `mode` is, in words for a message ('FIFO', 'device', ...)."""
    if stat.S_ISREG(mode):
        return "regular file"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "folder" if stat.S_ISDIR(mode) else "special file"


def read_local(
    path: str, url: str, limit_bytes: int | None, refusal: Callable[[str], CheckpointFormatError]
) -> bytes:
    """The bytes of a local regular file, at most `limit_bytes + 1` of them; see
    `Storage.read_small` (`path` is `url` on the local disk)."""
    try:
        st = os.stat(path)  # follows links: a link to /dev/zero is a device
    except FileNotFoundError:
        raise
    except OSError as e:
        raise StorageError(f"{url}: cannot read: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        raise refusal(f"a {file_kind(st.st_mode)}")
    if limit_bytes is not None and st.st_size > limit_bytes:
        raise refusal(f"{st.st_size} bytes")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise StorageError(f"{url}: cannot open for reading: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped for another kind since the stat above
            raise refusal(f"a {file_kind(st.st_mode)}")
        cap = None if limit_bytes is None else limit_bytes + 1
        parts: list[bytes] = []
        got = 0
        while cap is None or got < cap:
            # os.read allocates what it is asked for before it reads: ask for what the file
            # holds (plus a little, to see it end or grow), never a whole step for a small file
            want = min(READ_STEP_BYTES, max(st.st_size - got, 0) + _GROWTH_BYTES)
            part = os.read(fd, want if cap is None else min(cap - got, want))
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    finally:
        os.close(fd)


READ_STEP_BYTES = 8 * 2**20
"""The most one `os.read` asks for."""
_GROWTH_BYTES = 64 * 2**10
"""Asked for beyond a file's size as `stat` saw it: its end shows as a short read, and a file
that grew meanwhile is read on in steps of this size."""
