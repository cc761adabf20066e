"""What the page cache holds of a checkpoint, and the device kind, decide whether merges that
read it in place may run in parallel (`zerosafe.io.residency`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench._iolimit import drop_cache, residency
from zerosafe.io.residency import cached_fraction, rotational_device, serial_merge_reason

SIZE = 8 * 2**20


def _file(tmp_path: Path) -> str:
    path = tmp_path / "rank0.pt"
    path.write_bytes(os.urandom(SIZE))
    return str(path)


def _evict(path: str) -> None:
    drop_cache([path])


def _read(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(2**20):
            pass


def test_cached_fraction_sees_pages_come_and_go(tmp_path: Path) -> None:
    path = _file(tmp_path)
    _read(path)
    warm = cached_fraction([(path, 0, SIZE)])
    if warm is None:
        pytest.skip("this file system cannot say what the page cache holds (no RWF_NOWAIT)")
    assert warm == 1.0
    _evict(path)
    cold = cached_fraction([(path, 0, SIZE)])
    if cold == 1.0 and rotational_device(path) is None:
        pytest.skip("this file system keeps its pages (tmpfs): nothing to evict")
    assert cold == 0.0
    # The second half read again (readahead stops at the end of the file): half is cached,
    # and only the ranges given are counted.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(SIZE // 2)], SIZE // 2)
    finally:
        os.close(fd)
    half = cached_fraction([(path, 0, SIZE)])
    assert half is not None and 0.45 <= half <= 0.55
    resident = residency([path])  # util-linux `fincore` (mincore), where installed
    if resident is not None:
        assert half == resident / SIZE
    assert cached_fraction([(path, SIZE // 2, SIZE // 2)]) == 1.0
    assert cached_fraction([(path, 0, SIZE // 4)]) == 0.0


def test_nothing_to_sample() -> None:
    assert cached_fraction([]) is None
    assert serial_merge_reason([]) == ""


def test_no_block_device_is_not_rotational() -> None:
    assert rotational_device("/proc/self/status") is None
    assert rotational_device("/no/such/path") is None


def test_device_kind_is_read_from_sysfs(tmp_path: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    real = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    queues = [os.path.join(d, "queue", "rotational") for d in (real, os.path.dirname(real))]
    flags = [Path(q).read_text().strip() for q in queues if os.path.exists(q)]
    name = rotational_device(str(tmp_path))
    if not flags or flags[0] == "0":
        assert name is None
    else:
        assert name is not None
        assert name in (os.path.basename(real), os.path.basename(os.path.dirname(real)))


def test_serial_only_for_a_cold_checkpoint_on_a_rotational_device(tmp_path: Path) -> None:
    path = _file(tmp_path)
    _read(path)
    assert serial_merge_reason([(path, 0, SIZE)]) == ""  # cached: parallel merges are faster
    _evict(path)
    reason = serial_merge_reason([(path, 0, SIZE)])
    device = rotational_device(path)
    if device is None or cached_fraction([(path, 0, SIZE)]) is None:
        assert reason == ""
    else:
        assert f"'{device}'" in reason and "rotational" in reason and "one at a time" in reason
