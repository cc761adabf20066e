"""Reading the byte runs a training-state plan names: open sources counted, chunks with their
CRC-32s entered in a ledger, and the source records checked against their zip CRC-32s at the
end; the written units checked last, a failing one dropped so the next run redoes it. Shared
by `--to universal` and `--to dcp`."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from zerosafe.errors import IntegrityError, VerificationError
from zerosafe.formats.crc import CrcLedger
from zerosafe.io.storage import ByteSource, Storage, join_url
from zerosafe.run.unit_records import Stage, UnitRecords
from zerosafe.training_state.universal_plan import Run, SourceRecord

__all__ = [
    "Sources",
    "check_source_records",
    "check_units",
    "files_intact",
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


def files_intact(storage: Storage, out_url: str, written: Iterable[Mapping[str, Any]]) -> bool:
    """Whether every file a unit recorded (`path` under `out_url`, `size_bytes`) is there with
    its size: a recorded unit is kept only then (any storage error: it runs again)."""
    for w in written:
        try:
            if storage.identity(join_url(out_url, w["path"])).size_bytes != w["size_bytes"]:
                return False
        except Exception:  # noqa: BLE001 - any storage error: the unit runs again
            return False
    return True


def check_units(
    storage: Storage,
    out_url: str,
    records: UnitRecords,
    stage: Stage,
    units: Sequence[tuple[int, Sequence[Mapping[str, Any]]]],
    check: Callable[[Mapping[str, Any]], None],
) -> None:
    """Check every file of every unit (`(index, files written)`) with `check`, the final
    re-read. A unit with a file that fails is dropped, its record and its files, whether it
    ran now or was kept: a file damaged at its recorded size (a zero-filled block after a
    crash, bit rot on NFS) passes `files_intact`, and kept it would fail every later run.

    Raises:
        VerificationError: Naming the first failure and the units dropped; the next run of
            the command redoes them.
    """
    failed: dict[int, Exception] = {}
    for index, files in units:
        for w in files:
            try:
                check(w)
            except (VerificationError, ValueError) as e:  # damaged: its CRC, zip or pickle
                failed[index] = e
                break
    if not failed:
        return
    for index, files in units:
        if index in failed:
            records.drop(stage, index)
            for w in files:
                storage.remove(join_url(out_url, w["path"]))
    first = next(iter(failed.values()))
    raise VerificationError(
        f"{first}. {len(failed)} unit(s) of work failed this final check ({stage} "
        f"{', '.join(map(str, failed))}) and were dropped, their files removed: run the "
        "command again to redo them (the other units are kept)."
    ) from first


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
