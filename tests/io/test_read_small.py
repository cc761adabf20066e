"""`Storage.read_small`: the whole-file read of the small control files every reader opens
first (issue 37 item 8). A FIFO, a device or an oversized file is refused from its `stat`,
before it is opened or read, in one line naming the file, what was expected and what was found.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import fsspec
import pytest

from tests.rss import PeakRSS
from zerosafe.errors import CheckpointFormatError
from zerosafe.io.storage import Storage

pytestmark = pytest.mark.timeout(30)  # a FIFO opened for reading would block forever

LIMIT = 4096


def test_a_regular_file_up_to_the_limit_is_read_and_counted(tmp_path: Path) -> None:
    (tmp_path / "latest").write_bytes(b"x" * LIMIT)
    storage = Storage()
    assert storage.read_small(str(tmp_path / "latest"), limit_bytes=LIMIT, what="a tag") == (
        b"x" * LIMIT
    )
    assert storage.counter.bytes_read == LIMIT


def test_one_byte_over_the_limit_is_refused(tmp_path: Path) -> None:
    (tmp_path / "latest").write_bytes(b"x" * (LIMIT + 1))
    with pytest.raises(
        CheckpointFormatError,
        match=rf"latest: expected a tag, a regular file of at most {LIMIT} bytes, "
        rf"found {LIMIT + 1} bytes; replace it",
    ):
        Storage().read_small(str(tmp_path / "latest"), limit_bytes=LIMIT, what="a tag")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "latest")
    with pytest.raises(CheckpointFormatError, match=r"latest: expected a tag, .*found a FIFO"):
        Storage().read_small(str(tmp_path / "latest"), limit_bytes=LIMIT, what="a tag")
    # The uncapped read of larger files refuses it too, rather than block.
    with pytest.raises(CheckpointFormatError, match=r"found a FIFO"):
        Storage().read_bytes(str(tmp_path / "latest"))


def test_a_link_to_a_device_and_a_folder_are_refused(tmp_path: Path) -> None:
    os.symlink("/dev/zero", tmp_path / "latest")
    with pytest.raises(CheckpointFormatError, match=r"found a device"):
        Storage().read_small(str(tmp_path / "latest"), limit_bytes=LIMIT, what="a tag")
    with pytest.raises(CheckpointFormatError, match=r"found a folder"):
        Storage().read_small(str(tmp_path), limit_bytes=LIMIT, what="a tag")


def test_a_missing_file_stays_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Storage().read_small(str(tmp_path / "latest"), limit_bytes=LIMIT, what="a tag")


def test_a_huge_sparse_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "fsdp_config.json"
    with open(path, "wb") as f:
        f.truncate(2 * 2**30)
    with PeakRSS() as rss:
        with pytest.raises(CheckpointFormatError, match=rf"found {2 * 2**30} bytes"):
            Storage().read_small(str(path), limit_bytes=LIMIT, what="a config")
    assert rss.peak - rss.baseline < 64 * 2**20


def test_an_fsspec_file_is_checked_by_its_info() -> None:
    root = f"memory://read-small-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{root}/small.json", b"{}")
    fs.pipe(f"{root}/big.json", b" " * (LIMIT + 1))
    storage = Storage()
    assert storage.read_small(f"{root}/small.json", limit_bytes=LIMIT, what="JSON") == b"{}"
    with pytest.raises(CheckpointFormatError, match=rf"big.json: .*found {LIMIT + 1} bytes"):
        storage.read_small(f"{root}/big.json", limit_bytes=LIMIT, what="JSON")
    fs.pipe(f"{root}/dir/x", b"")
    with pytest.raises(CheckpointFormatError, match=r"found a directory"):
        storage.read_small(f"{root}/dir", limit_bytes=LIMIT, what="JSON")
