"""The conversion's stages as plain functions of (plan, index): what the Prefect tasks call.

- `extract_part`: copy one part of one rank's slots (fp32 partitions, frozen fragments,
  buffers) from the checkpoint into an intermediate safetensors file, plus a sidecar JSON with
  the content hash and per-tensor CRC32s written once the file is whole.
- `merge_shard`: write one output shard, streaming each tensor's fragments in order, from the
  intermediates (`StagedLocator`) or straight from the checkpoint (`DirectLocator`).
- `check_integrity`: combine the CRC32 pieces every task read and compare them with the zip
  records' CRCs and the intermediates' recorded CRCs.

Verification and publishing live in `zerosafe.verify.tensors` and `zerosafe.stages.output`.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from zerosafe.cast import cast_into
from zerosafe.errors import IntegrityError
from zerosafe.formats.base import Slot
from zerosafe.formats.crc import CrcLedger, LedgerCheck, crc32
from zerosafe.formats.safetensors import (
    HeaderEntry,
    SafetensorsHeader,
    SafetensorsStreamWriter,
    read_entries,
)
from zerosafe.io.mapped import map_source
from zerosafe.io.storage import ByteSource, PositionalSink, Storage, is_local, join_url
from zerosafe.plan.model import SCALE_ROLE, ExtractPart, Plan, TensorSpec
from zerosafe.quantize import BAND_ROWS, QuantizedBand, global_scale, quantize_band
from zerosafe.records import Record
from zerosafe.stages.results import ExtractResult, MergeResult
from zerosafe.stages.streaming import CopyJob, CopyPolicy, copy_in_streams, copy_stream, fusable
from zerosafe.verify.checksum import TENSOR_CHECKSUM

__all__ = [
    "DirectLocator",
    "Segment",
    "SlotLocator",
    "StagedLocator",
    "check_integrity",
    "extract_part",
    "intermediate_tensor_name",
    "merge_shard",
    "record_key",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Segment:
    """Where a run of a slot's elements can be read."""

    source: ByteSource
    offset: int
    nbytes: int
    crc_key: str
    crc_offset: int


class SlotLocator(Protocol):
    """Maps `(slot, first element, count)` to byte ranges of readable files."""

    def locate(self, slot: int, start: int, numel: int) -> list[Segment]: ...

    def close(self) -> None: ...


def record_key(plan: Plan, slot: Slot) -> str:
    """The CRC ledger's key of a slot's source record: its file and the offset of its first
    data byte, which tell any two records apart whatever the format names them (each DCP
    chunk is its own archive, so every chunk's record is `archive/data/0`). The record's name
    is there for people reading the integrity report."""
    return f"{plan.files[slot.file].url}#{slot.record}@{slot.record_offset}"


def _check_identity(plan: Plan, file_index: int, source: ByteSource) -> None:
    planned = plan.files[file_index]
    if source.size_bytes != planned.size_bytes:
        raise IntegrityError(
            f"{source.url}: {source.size_bytes} bytes now but {planned.size_bytes} when the "
            "conversion was planned; the checkpoint changed under us. Run the conversion again."
        )


class DirectLocator:
    """Reads slots straight from the checkpoint's files (direct mode, and extract)."""

    def __init__(self, plan: Plan, storage: Storage) -> None:
        self.plan = plan
        self.storage = storage
        self._sources: dict[int, ByteSource] = {}
        self._lock = threading.Lock()

    def source(self, file_index: int) -> ByteSource:
        with self._lock:
            src = self._sources.get(file_index)
            if src is None:
                src = map_source(
                    self.storage.open_source(self.plan.files[file_index].url), self.storage.counter
                )
                _check_identity(self.plan, file_index, src)
                self._sources[file_index] = src
        return src

    def locate(self, slot: int, start: int, numel: int) -> list[Segment]:
        s = self.plan.slots[slot]
        offset = s.byte_offset + start * s.itemsize
        key = record_key(self.plan, s)
        return [
            Segment(self.source(s.file), offset, numel * s.itemsize, key, offset - s.record_offset)
        ]

    def close(self) -> None:
        for src in self._sources.values():
            src.close()
        self._sources.clear()


def intermediate_tensor_name(slot: int, start: int, numel: int) -> str:
    return f"{slot}:{start}:{numel}"


def _sidecar_url(file_url: str) -> str:
    return file_url.removesuffix(".safetensors") + ".json"


@dataclass(frozen=True, kw_only=True, slots=True)
class IntermediateSums(Record):
    """An intermediate's sidecar (`<part>.json`): what its extract wrote, for the merges'
    cache keys and the CRC checks."""

    job_key: str
    file: str
    file_bytes: int
    content_sha256: str
    """Hash of the intermediate's tensor bytes (`ExtractResult.content_sha256`)."""
    crc32: dict[str, int]
    """Tensor name -> its CRC-32."""


class StagedLocator:
    """Reads slots from the intermediate files the extract stage wrote."""

    def __init__(self, plan: Plan, storage: Storage, intermediate_url: str) -> None:
        self.plan = plan
        self.storage = storage
        self.folder = intermediate_url
        self._by_slot: dict[int, list[tuple[int, int, int]]] = {}
        for part in plan.parts:
            for slot, start, numel in part.pieces:
                self._by_slot.setdefault(slot, []).append((start, numel, part.index))
        for pieces in self._by_slot.values():
            pieces.sort()
        self._open: dict[int, tuple[ByteSource, SafetensorsHeader, int]] = {}
        self._lock = threading.Lock()

    def part_url(self, part: ExtractPart) -> str:
        return join_url(self.folder, part.file_name)

    def _part(self, index: int) -> tuple[ByteSource, SafetensorsHeader, int]:
        with self._lock:
            hit = self._open.get(index)
            if hit is not None:
                return hit
            part = self.plan.parts[index]
            url = self.part_url(part)
            src = map_source(self.storage.open_source(url), self.storage.counter)
            header, metadata, data_start = read_entries(src)
            if metadata.get("job_key") != self.plan.job_key:
                raise IntegrityError(
                    f"{url}: intermediate of plan '{metadata.get('job_key')}', not of this plan "
                    f"'{self.plan.job_key}'; delete the work area and run again"
                )
            self._open[index] = (src, header, data_start)
            return self._open[index]

    def locate(self, slot: int, start: int, numel: int) -> list[Segment]:
        out = []
        end = start + numel
        itemsize = self.plan.slots[slot].itemsize
        for p_start, p_numel, part in self._by_slot.get(slot, []):
            p_end = p_start + p_numel
            lo, hi = max(start, p_start), min(end, p_end)
            if lo >= hi:
                continue
            src, header, data_start = self._part(part)
            name = intermediate_tensor_name(slot, p_start, p_numel)
            base = data_start + header[name].data_offsets[0]
            rel = (lo - p_start) * itemsize
            out.append(Segment(src, base + rel, (hi - lo) * itemsize, f"{src.url}#{name}", rel))
        if sum(s.nbytes for s in out) != numel * itemsize:
            raise IntegrityError(
                f"{self.folder}: no intermediate holds elements [{start}, {end}) of slot {slot}"
            )
        return out

    def close(self) -> None:
        for src, _, _ in self._open.values():
            src.close()
        self._open.clear()


# -- extract -------------------------------------------------------------------------------------


def extract_part(
    plan: Plan,
    index: int,
    storage: Storage,
    intermediate_url: str,
    *,
    chunk_bytes: int,
    on_bytes: Callable[[int], None] | None = None,
    copy: CopyPolicy | None = None,
) -> ExtractResult:
    """Copy one extract part's slot ranges from the checkpoint into an intermediate file
    (`copy`: how the run's copies run, `CopyPolicy`).

    Returns:
        The file URL, bytes, content hash and the CRC ledger of the source records read.
    """
    started = time.monotonic()
    part = plan.parts[index]
    url = join_url(intermediate_url, part.file_name)
    locator = DirectLocator(plan, storage)
    entries = []
    jobs = []
    for i, (slot_index, start, numel) in enumerate(part.pieces):
        slot = plan.slots[slot_index]
        entries.append(
            HeaderEntry(intermediate_tensor_name(slot_index, start, numel), slot.dtype, (numel,))
        )
        for seg in locator.locate(slot_index, start, numel):
            jobs.append(
                CopyJob(
                    i,
                    seg.source,
                    seg.offset,
                    seg.nbytes,
                    slot.dtype,
                    slot.dtype,
                    seg.crc_key,
                    seg.crc_offset,
                )
            )
    files = sorted({plan.slots[s].file for s, _, _ in part.pieces})
    metadata = {
        "format": "zerosafe-intermediate",
        "job_key": plan.job_key,
        "part": str(index),
        "rank": str(part.rank),
        "source": json.dumps(
            [
                {
                    "url": plan.files[f].url,
                    "size_bytes": plan.files[f].size_bytes,
                    "version": plan.files[f].version,
                }
                for f in files
            ]
        ),
    }
    ledger = CrcLedger()
    storage.makedirs(intermediate_url)
    writer = SafetensorsStreamWriter(storage.open_sink(url), entries, metadata)
    try:
        bytes_read = copy_stream(
            jobs, writer, chunk_bytes=chunk_bytes, ledger=ledger, on_bytes=on_bytes, copy=copy
        )
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        locator.close()
    content = _content_hash(writer.digests)
    sums = IntermediateSums(
        job_key=plan.job_key,
        file=part.file_name,
        file_bytes=writer.file_bytes,
        content_sha256=content,
        crc32={e.name: c for e, c in zip(entries, writer.crc32, strict=True)},
    )
    storage.write_bytes(_sidecar_url(url), json.dumps(sums.to_json()).encode())
    log.info(
        "extract rank %d part %d: %d bytes into %s in %.1f s",
        part.rank, part.number, writer.file_bytes, part.file_name, time.monotonic() - started,
    )  # fmt: skip
    return ExtractResult(
        part=index,
        rank=part.rank,
        file=url,
        file_bytes=writer.file_bytes,
        bytes_read=bytes_read,
        content_sha256=content,
        ledger=ledger.to_json(),
        seconds=round(time.monotonic() - started, 3),
    )


def _content_hash(tensor_hashes: list[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(tensor_hashes).encode()).hexdigest()


def read_intermediate_sums(
    storage: Storage, intermediate_url: str, part: ExtractPart
) -> IntermediateSums | None:
    """The sidecar of an intermediate, or None if the file or its sidecar is missing, torn,
    or does not match the file's size (then the part is extracted again)."""
    url = join_url(intermediate_url, part.file_name)
    if not storage.exists(url) or not storage.exists(_sidecar_url(url)):
        return None
    try:  # a RecordError is a ValueError
        sums = IntermediateSums.from_json(json.loads(storage.read_bytes(_sidecar_url(url))))
    except ValueError:
        return None
    if storage.identity(url).size_bytes != sums.file_bytes:
        return None
    return sums


# -- merge ---------------------------------------------------------------------------------------


def _merge_jobs(plan: Plan, shard: int, locator: SlotLocator) -> Iterator[CopyJob]:
    for ordinal, tensor in enumerate(plan.shard_tensors(shard)):
        yield from _tensor_jobs(plan, tensor, ordinal, locator)


def _tensor_jobs(
    plan: Plan, tensor: TensorSpec, ordinal: int, locator: SlotLocator
) -> Iterator[CopyJob]:
    """The copies that write `tensor`, the `ordinal`-th of its file."""
    for slot, src_offset, numel, _dst in plan.fragments.for_tensor(tensor.index):
        src_dtype = plan.slots[slot].dtype
        for seg in locator.locate(slot, src_offset, numel):
            yield CopyJob(
                ordinal,
                seg.source,
                seg.offset,
                seg.nbytes,
                src_dtype,
                tensor.out_dtype,
                seg.crc_key,
                seg.crc_offset,
            )


def _copy_quantizing(
    plan: Plan,
    shard: int,
    locator: SlotLocator,
    writer: SafetensorsStreamWriter,
    *,
    chunk_bytes: int,
    ledger: CrcLedger,
    on_bytes: Callable[[int], None] | None,
    copy: CopyPolicy | None = None,
    streams: int = 1,
) -> int:
    """Write a shard that holds quantized weights (`--quantize`): the other tensors through
    `copy_stream`, as always; each quantized weight a band of 128 rows at a time
    (`_quantize_tensor`), its scales as the tensor after it. With `streams` > 1, local
    sources and a scheme quantized in numpy (`fp8-block` with float scales, `fp8-dynamic`),
    that many threads read and quantize bands side by side (numpy releases the GIL), in
    order, one band each.

    Returns:
        Bytes read from the sources.
    """
    tensors = plan.shard_tensors(shard)
    read = 0
    pending: list[CopyJob] = []
    ordinal = 0
    in_torch = plan.options["quantize"] == "nvfp4a16" or (
        plan.options.get("quantize_scale_fmt", "float") == "ue8m0"
    )  # torch's own threads would contend with ours
    if in_torch or not all(is_local(f.url) for f in plan.files):
        streams = 1
    with ThreadPoolExecutor(streams, thread_name_prefix="quantize") as pool:
        while ordinal < len(tensors):
            tensor = tensors[ordinal]
            if not tensor.quantized:
                pending.extend(_tensor_jobs(plan, tensor, ordinal, locator))
                ordinal += 1
                continue
            if pending:
                read += copy_stream(
                    pending, writer, chunk_bytes=chunk_bytes, ledger=ledger, on_bytes=on_bytes,
                    copy=copy,
                )  # fmt: skip
                pending = []
            assert tensors[ordinal + 1].role == SCALE_ROLE, tensors[ordinal + 1]
            read += _quantize_tensor(
                plan, tensor, ordinal, locator, writer, ledger, on_bytes, pool=pool,
                streams=streams,
            )  # fmt: skip
            ordinal += 1
            while ordinal < len(tensors) and tensors[ordinal].role == SCALE_ROLE:
                ordinal += 1
    if pending:
        read += copy_stream(
            pending, writer, chunk_bytes=chunk_bytes, ledger=ledger, on_bytes=on_bytes, copy=copy
        )
    return read


@dataclass
class _Band:
    """One band read and quantized: what the writer and the CRC ledger get from it."""

    quantized: QuantizedBand
    crcs: list[tuple[str, int, int, int]]
    """`(crc key, offset, bytes, CRC32)` of each range read."""
    read: int


def _quantize_tensor(
    plan: Plan,
    tensor: TensorSpec,
    ordinal: int,
    locator: SlotLocator,
    writer: SafetensorsStreamWriter,
    ledger: CrcLedger,
    on_bytes: Callable[[int], None] | None,
    *,
    pool: ThreadPoolExecutor,
    streams: int,
) -> int:
    """Write weight `tensor` (the `ordinal`-th of the file) quantized in `--quantize`'s
    scheme and its scales after it: each band of 128 rows is read from the fragments that
    cover it (`_read_band`), quantized (`zerosafe.quantize.quantize_band`) and written, in
    order; the band's scales (one per block, row or group) are kept until the weight is
    done. `nvfp4a16` first reads the bands once more for the weight's largest magnitude (its
    global scale, written last; that pass's reads are CRC'd by the next). At most `streams`
    bands are read and quantized at once, on `pool`'s threads (one: in this thread), each
    holding `BAND_BYTES_PER_COLUMN * cols` bytes.

    Returns:
        Bytes read.
    """
    import numpy as np

    rows, cols = tensor.source_shape
    scheme = str(plan.options["quantize"])
    scale_fmt = str(plan.options.get("quantize_scale_fmt", "float"))
    read, whole = 0, None
    if scheme == "nvfp4a16":
        import torch

        amax = np.float32(0.0)
        for first_row in range(0, rows, BAND_ROWS):
            values, _, nbytes = _read_band(plan, tensor, locator, first_row)
            amax = np.maximum(amax, np.abs(values).max())  # NaN carries, as torch.maximum
            read += nbytes
            if on_bytes is not None:
                on_bytes(nbytes)
        whole = global_scale(torch.from_numpy(np.asarray(amax, dtype=np.float32)))

    def band(first_row: int) -> _Band:
        values, crcs, nbytes = _read_band(plan, tensor, locator, first_row)
        quantized = quantize_band(scheme, values.reshape(-1, cols), whole, scale_fmt=scale_fmt)
        return _Band(quantized, crcs, nbytes)

    firsts = iter(range(0, rows, BAND_ROWS))
    window = deque(pool.submit(band, r) for r in itertools.islice(firsts, streams - 1))
    scales = []
    while True:
        if streams > 1:  # the pool's threads read and quantize ahead, in order
            window.extend(pool.submit(band, r) for r in itertools.islice(firsts, 1))
            if not window:
                break
            done = window.popleft().result()
        else:
            row = next(firsts, None)
            if row is None:
                break
            done = band(row)
        for key, offset, nbytes, crc in done.crcs:
            ledger.add(key, offset, nbytes, crc)
        read += done.read
        if on_bytes is not None:
            on_bytes(done.read)
        writer.write(ordinal, done.quantized.data)
        scales.append(np.asarray(done.quantized.scales))
    writer.write(ordinal + 1, np.concatenate(scales).tobytes())
    if whole is not None:
        writer.write(ordinal + 2, whole.numpy().tobytes())
    return read


def _read_band(
    plan: Plan, tensor: TensorSpec, locator: SlotLocator, first_row: int
) -> tuple[Any, list[tuple[str, int, int, int]], int]:
    """The float32 values of rows `[first_row, first_row + 128)` of `tensor`'s source (a
    flat numpy array) from the fragments that cover them: fp32 masters read straight into
    it, a frozen 16-bit param widened exactly. Returns the values, the CRCs of the ranges
    read and the bytes read."""
    import numpy as np

    rows, cols = tensor.source_shape
    lo, hi = first_row * cols, min(rows, first_row + BAND_ROWS) * cols
    band = np.empty(hi - lo, dtype=np.float32)
    band_bytes = band.data.cast("B")
    crcs = []
    read = 0
    for slot_index, src_offset, numel, dst in plan.fragments.for_tensor(tensor.index):
        start, end = max(lo, dst), min(hi, dst + numel)
        if start >= end:
            continue
        slot = plan.slots[slot_index]
        at = start - lo
        for seg in locator.locate(slot_index, src_offset + start - dst, end - start):
            count = seg.nbytes // slot.itemsize
            if slot.dtype == "float32":  # the masters: read straight into the band
                data = band_bytes[at * 4 : (at + count) * 4]
                seg.source.readinto_at(seg.offset, data)
            else:  # a frozen 16-bit param: widened exactly
                data = memoryview(bytearray(seg.nbytes))
                seg.source.readinto_at(seg.offset, data)
                cast_into(data, slot.dtype, band_bytes[at * 4 :], "float32", count)
            crcs.append((seg.crc_key, seg.crc_offset, seg.nbytes, crc32(data)))
            at += count
            read += seg.nbytes
    return band, crcs, read


def _stream_bounds(entries: list[HeaderEntry], streams: int) -> list[int]:
    """Tensor indices cutting `entries` into at most `streams` runs of about equal bytes."""
    total = sum(e.nbytes for e in entries)
    bounds, done = [0], 0
    for i, entry in enumerate(entries[:-1]):
        done += entry.nbytes
        if done * streams >= total * len(bounds) and len(bounds) < streams:
            bounds.append(i + 1)
    bounds.append(len(entries))
    return bounds


def _copy_in_streams(
    jobs: list[CopyJob],
    writer: SafetensorsStreamWriter,
    streams: int,
    ledger: CrcLedger,
    on_bytes: Callable[[int], None] | None,
) -> int:
    """Copy `jobs` (local files, in tensor order) in up to `streams` threads, each copying a
    run of whole tensors block by block (`copy_in_streams`: a few MiB per thread) into its
    own range of the file; the per-tensor digests and the CRC ledger are theirs, in order.
    One shard then uses as many cores as are idle, as when it is the last of a run."""
    bounds = _stream_bounds(writer.entries, streams)
    assert isinstance(writer.sink, PositionalSink)
    parts = writer.ranges(bounds, writer.sink.write_at)
    ledgers = [CrcLedger() for _ in parts]
    owner = [0] * len(writer.entries)
    for n, (first, last) in enumerate(zip(bounds, bounds[1:], strict=False)):
        owner[first:last] = [n] * (last - first)
    groups: list[list[CopyJob]] = [[] for _ in parts]
    for job in jobs:
        groups[owner[job.tensor]].append(job)

    read = copy_in_streams(groups, list(parts), ledgers, on_bytes)
    writer.adopt(parts)
    for part_ledger in ledgers:
        ledger.update(part_ledger)
    return read


def shard_metadata(plan: Plan, shard: int) -> dict[str, str]:
    """`__metadata__` of an output shard: the HF format tag, and tied aliases stored here."""
    names = {t.name for t in plan.shard_tensors(shard)}
    metadata = {"format": "pt"}
    aliases = {a: t for a, t in plan.aliases.items() if t in names}
    if aliases:
        metadata["aliases"] = json.dumps(aliases, sort_keys=True)
    return metadata


def merge_shard(
    plan: Plan,
    shard: int,
    storage: Storage,
    out_url: str,
    locator: SlotLocator,
    *,
    chunk_bytes: int,
    on_bytes: Callable[[int], None] | None = None,
    streams: int = 1,
    copy: CopyPolicy | None = None,
) -> MergeResult:
    """Write output shard `shard` into folder `out_url`; with `streams` > 1, local files
    are copied by that many threads at once, each filling its own range of tensors
    (`_copy_in_streams`); otherwise as `copy` says (`CopyPolicy`).

    Returns:
        The file, sizes, each tensor's checksum (`TENSOR_CHECKSUM`) and the CRC ledger of
        what was read.
    """
    started = time.monotonic()
    spec = plan.shards[shard]
    tensors = plan.shard_tensors(shard)
    entries = [HeaderEntry(t.name, t.out_dtype, t.shape) for t in tensors]
    url = join_url(out_url, spec.file_name)
    ledger = CrcLedger()
    storage.makedirs(out_url)
    # Output shards are checked by their per-tensor checksum (verify); only intermediates
    # need CRCs.
    writer = SafetensorsStreamWriter(
        storage.open_sink(url), entries, shard_metadata(plan, shard), track_crc=False,
        checksum=TENSOR_CHECKSUM,
    )  # fmt: skip
    quantizing = any(t.role == SCALE_ROLE for t in tensors)
    jobs = [] if quantizing else list(_merge_jobs(plan, shard, locator))
    try:
        if quantizing:
            bytes_read = _copy_quantizing(
                plan, shard, locator, writer, chunk_bytes=chunk_bytes, ledger=ledger,
                on_bytes=on_bytes, copy=copy, streams=streams,
            )  # fmt: skip
        elif streams > 1 and isinstance(writer.sink, PositionalSink) and fusable(jobs, writer):
            bytes_read = _copy_in_streams(jobs, writer, streams, ledger, on_bytes)
        else:
            bytes_read = copy_stream(
                jobs, writer, chunk_bytes=chunk_bytes, ledger=ledger, on_bytes=on_bytes,
                copy=copy,
            )  # fmt: skip
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    log.info(
        "merge shard %d/%d: %d tensors, %d bytes into %s in %.1f s",
        shard + 1, len(plan.shards), len(tensors), writer.file_bytes, spec.file_name,
        time.monotonic() - started,
    )  # fmt: skip
    return MergeResult(
        shard=shard,
        file=spec.file_name,
        file_bytes=writer.file_bytes,
        data_bytes=writer.data_bytes,
        bytes_read=bytes_read,
        tensors={
            t.name: {TENSOR_CHECKSUM: h, "dtype": t.out_dtype, "shape": list(t.shape)}
            for t, h in zip(tensors, writer.digests, strict=True)
        },
        ledger=ledger.to_json(),
        seconds=round(time.monotonic() - started, 3),
    )


# -- integrity -----------------------------------------------------------------------------------


def check_integrity(
    plan: Plan,
    storage: Storage,
    ledgers: list[dict[str, list[list[int]]]],
    *,
    intermediate_url: str | None = None,
) -> LedgerCheck:
    """Check every record read against its CRC: zip records (source) and intermediates.

    Args:
        ledgers: The `ledger` of every extract and merge summary.
        intermediate_url: Folder of the intermediates, in staged mode.

    Raises:
        IntegrityError: If any record's bytes do not match its CRC.
    """
    ledger = CrcLedger()
    for data in ledgers:
        ledger.update(CrcLedger.from_json(data))
    expected: dict[str, tuple[int, int]] = {}
    where: dict[str, tuple[str, int]] = {}  # key -> (url, absolute offset of byte 0)
    for slot in plan.slots:
        key = record_key(plan, slot)
        where[key] = (plan.files[slot.file].url, slot.record_offset)
        if slot.record_crc32 != 0 or slot.record_size_bytes == 0:
            expected[key] = (slot.record_size_bytes, slot.record_crc32)
    if intermediate_url is not None:
        for part in plan.parts:
            url = join_url(intermediate_url, part.file_name)
            if not any(k.startswith(url + "#") for k in ledger.keys()):
                continue
            sums = read_intermediate_sums(storage, intermediate_url, part)
            if sums is None:
                raise IntegrityError(f"{url}: intermediate or its checksum sidecar is missing")
            src = storage.open_source(url)
            header, _, data_start = read_entries(src)
            src.close()
            for name, crc in sums.crc32.items():
                begin, end = header[name].data_offsets
                expected[f"{url}#{name}"] = (end - begin, int(crc))
                where[f"{url}#{name}"] = (url, data_start + begin)
    sources: dict[str, ByteSource] = {}

    def read_gap(key: str, offset: int, length: int) -> bytes:
        url, base = where[key]
        if url not in sources:
            sources[url] = storage.open_source(url)
        return sources[url].read_range(base + offset, base + offset + length)

    try:
        result = ledger.check(expected, read_gap)
    finally:
        for src in sources.values():
            src.close()
    if result.failed:
        detail = "; ".join(f"{k}: {w}" for k, w in result.failed[:5])
        raise IntegrityError(
            f"{len(result.failed)} record(s) read do not match their recorded CRC32 ({detail}). "
            "The files are corrupt or changed during the run; copy them again and re-run."
        )
    return result
