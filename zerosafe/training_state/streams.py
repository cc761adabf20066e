"""Reading the byte runs a training-state plan names: open sources counted, chunks with their
CRC-32s entered in a ledger, and the source records checked against their zip CRC-32s at the
end. Shared by `--to universal` and `--to dcp`."""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from zerosafe.errors import IntegrityError
from zerosafe.formats.crc import CrcLedger
from zerosafe.formats.torch_pickle import TensorRecord
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import ByteSource, Storage
from zerosafe.run.unit_records import UnitRecords
from zerosafe.targets.base import UnitWork
from zerosafe.training_state.universal_plan import Run, SourceRecord

__all__ = [
    "SourcesOfPlan",
    "Sources",
    "UnitJob",
    "check_plan_sources",
    "check_source_records",
    "read_runs",
    "record_crc",
    "to_float32",
]

CHUNK_BYTES = 8 << 20


class _Ranged(Protocol):
    def read_range(self, start: int, end: int) -> bytes: ...


def record_crc(source: _Ranged, start: int, size_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The CRC-32 of `size_bytes` of `source` from `start`, read in chunks."""
    crc = 0
    for pos in range(start, start + size_bytes, chunk_bytes):
        crc = zlib.crc32(source.read_range(pos, min(pos + chunk_bytes, start + size_bytes)), crc)
    return crc


log = logging.getLogger(__name__)


class Sources:
    """Open source files by plan index, counting the bytes read."""

    def __init__(self, storage: Storage, urls: list[str]) -> None:
        self._storage = storage
        self._urls = urls
        self._open: dict[int, ByteSource] = {}
        self.bytes_read = 0

    def read(self, file: int, start: int, end: int) -> bytes:
        src = self._open.get(file)
        if src is None:
            src = self._open[file] = self._storage.open_source(self._urls[file])
        self.bytes_read += end - start
        return src.read_range(start, end)

    def close(self) -> None:
        for src in self._open.values():
            src.close()
        self._open.clear()


def to_float32(raw: bytes, dtype: str) -> bytes:
    """Elements of `dtype` as float32, exactly as torch's `.float()` converts them."""
    if dtype == "float32":
        return raw
    if dtype == "bfloat16":  # bf16 is the top half of a float32: exact
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).tobytes()
    return np.frombuffer(raw, np.dtype(dtype)).astype(np.float32).tobytes()


def read_runs(
    sources: Sources,
    records: list[SourceRecord],
    runs: tuple[Run, ...],
    *,
    chunk_bytes: int,
    ledger: CrcLedger,
    itemsize: int = 4,
) -> Iterator[tuple[bytes, int | None]]:
    """`(bytes, CRC-32)` of each chunk of `runs`; a run inside a zip record adds its chunks'
    CRCs to `ledger` (checked against the record's CRC by `check_source_records`)."""
    step = max(chunk_bytes // itemsize, 1) * itemsize
    for run in runs:
        end = run.offset + run.numel * itemsize
        record = records[run.record] if run.record >= 0 else None
        for pos in range(run.offset, end, step):
            data = sources.read(run.file, pos, min(pos + step, end))
            crc = None
            if record is not None:
                crc = zlib.crc32(data)
                ledger.add(record.key, pos - record.data_offset, len(data), crc)
            yield data, crc


def check_source_records(
    sources: Sources, records: list[SourceRecord], ledger: CrcLedger, *, units: UnitRecords
) -> int:
    """Every source record read, its pieces' CRC-32s combined (padding read in), against the
    CRC-32 its zip directory records; returns how many were checked. On a mismatch every unit
    of `units` is dropped: a kept unit would keep the bytes and CRC-32s it read from the bad
    file, and fail every later run the same way, the file fixed or not.

    Raises:
        IntegrityError: If one differs: the checkpoint is corrupt or changed during the run.
    """
    by_key = {r.key: r for r in records}
    expected = {
        r.key: (r.size_bytes, r.crc32) for r in records if r.crc32 != 0 or r.size_bytes == 0
    }

    def read_gap(key: str, offset: int, length: int) -> bytes:
        r = by_key[key]
        return sources.read(r.file, r.data_offset + offset, r.data_offset + offset + length)

    gap: Callable[[str, int, int], bytes] = read_gap
    result = ledger.check(expected, gap)
    if result.failed:
        units.clear()
        detail = "; ".join(f"{k}: {w}" for k, w in result.failed[:5])
        raise IntegrityError(
            f"{len(result.failed)} record(s) of the checkpoint do not match their recorded "
            f"CRC-32 ({detail}). The files are corrupt or changed during the run; every unit "
            "of work was dropped: copy them again and run the command again."
        )
    for key, why in result.skipped:
        log.info("%s: not checked against its CRC-32 (%s)", key, why)
    return len(result.checked)


def check_plan_sources(
    storage: Storage,
    urls: list[str],
    records: list[SourceRecord],
    ledger: CrcLedger,
    *,
    units: UnitRecords,
) -> tuple[int, int]:
    """`check_source_records` with the plan's files opened for it: returns the records
    checked and the bytes read to check them."""
    sources = Sources(storage, urls)
    try:
        return check_source_records(sources, records, ledger, units=units), sources.bytes_read
    finally:
        sources.close()


@dataclass(kw_only=True)
class UnitJob:
    """What one unit of a training-state target reads and writes with: its own open sources,
    byte counts and CRC ledger (units run on several threads at once), the plan's files."""

    storage: Storage
    out_url: str
    chunk_bytes: int
    urls: list[str]
    records: list[SourceRecord]
    small_zip: TorchZipFile
    """Rank 0's optimizer file, whence every small state comes (shared by every unit)."""
    small_lock: threading.Lock
    """Held around reads through `small_zip`."""
    sources: Sources = field(init=False)
    bytes_written: int = 0
    ledger: CrcLedger = field(default_factory=CrcLedger)
    """CRC-32s of the source bytes the unit read, by record."""

    def __post_init__(self) -> None:
        self.sources = Sources(self.storage, self.urls)

    def chunks(
        self, runs: tuple[Run, ...], itemsize: int = 4
    ) -> Iterator[tuple[bytes, int | None]]:
        """`(bytes, CRC-32)` of each chunk of `runs`; a run inside a zip record adds its
        chunks' CRCs to the unit's ledger (checked against the record's CRC at the end)."""
        return read_runs(
            self.sources, self.records, runs, chunk_bytes=self.chunk_bytes, ledger=self.ledger,
            itemsize=itemsize,
        )  # fmt: skip

    def read_small(self, t: TensorRecord) -> bytes:
        """A small tensor of rank 0's optimizer file, read whole."""
        with self.small_lock:
            raw = self.small_zip.read_tensor_bytes(t)
        self.sources.bytes_read += t.nbytes
        return raw

    def done(self, files: list[Mapping[str, Any]]) -> UnitWork:
        """What the unit did, its sources closed."""
        self.sources.close()
        return UnitWork(
            files=[dict(f) for f in files], ledger=self.ledger,
            bytes_read=self.sources.bytes_read, bytes_written=self.bytes_written,
        )  # fmt: skip


class SourcesOfPlan:
    """What both training-state targets do with their plan's source files: open them for a
    unit (`unit_job`) and check every record read against its zip CRC-32 (`check_source`)."""

    urls: list[str]
    records: list[SourceRecord]
    small_zip: TorchZipFile

    def __init__(self) -> None:
        self._small_lock = threading.Lock()

    def unit_job(self, storage: Storage, out_url: str, chunk_bytes: int) -> dict[str, Any]:
        """The `UnitJob` fields of one unit."""
        return {"storage": storage, "out_url": out_url, "chunk_bytes": chunk_bytes,
                "urls": self.urls, "records": self.records, "small_zip": self.small_zip,
                "small_lock": self._small_lock}  # fmt: skip

    def check_source(
        self, storage: Storage, ledger: CrcLedger, records: UnitRecords
    ) -> tuple[int, int]:
        return check_plan_sources(storage, self.urls, self.records, ledger, units=records)
