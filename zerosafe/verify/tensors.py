"""Independent checks of written safetensors files and Hugging Face style outputs.

This module never uses the writer's code: it parses headers with a parser of its own, has the
`safetensors` library open every local file as a second, independent reader, and streams
each tensor's bytes in bounded chunks to recompute the per-tensor checksums and count NaN/Inf,
and, when asked (`file_sha256`), feeds the same bytes, header first, to one SHA-256 of the
whole file: the hash the Hugging Face Hub (Git LFS) records for an uploaded file.
Format: https://github.com/huggingface/safetensors#format; index format: transformers'
`model.safetensors.index.json` (`metadata.total_size`, `weight_map`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from zerosafe.dtypes import from_safetensors_code, torch_dtype
from zerosafe.formats.safetensors import SafetensorsHeader, StoredEntry
from zerosafe.io.buffers import allocate_buffer, pin_mmap_threshold
from zerosafe.io.mapped import map_source
from zerosafe.io.storage import ByteSource, Storage, is_local, local_path
from zerosafe.verify.checksum import TENSOR_CHECKSUM, Digest, new_digest, recorded_checksum

__all__ = [
    "Failure",
    "ShardReport",
    "parse_safetensors_header",
    "verify_shard",
]

log = logging.getLogger(__name__)

_MAX_HEADER = 100_000_000


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed check: which file and tensor, which check, and what was found."""

    file: str
    tensor: str
    check: str
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {
            "file": self.file,
            "tensor": self.tensor,
            "check": self.check,
            "detail": self.detail,
        }


@dataclass
class ShardReport:
    file: str
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """name -> {dtype, shape, <checksum algorithm>: digest, nan, posinf, neginf}."""
    metadata: dict[str, str] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    bytes_read: int = 0
    sha256: str | None = None
    """SHA-256 of the whole file's bytes, when asked for (`verify_shard(file_sha256=True)`)."""
    quantized: dict[str, int] = field(default_factory=dict)
    """Quantized weights (`zerosafe.verify.quantized`): `tensors`, `params`, `bytes` with
    their scales; empty when the file holds none."""

    @property
    def ok(self) -> bool:
        return not self.failures


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key '{k}' appears twice in the header")
        out[k] = v
    return out


def parse_safetensors_header(source: ByteSource) -> tuple[SafetensorsHeader, dict[str, str], int]:
    """`(entries, metadata, data_start)`, validating the header's own structure.

    Raises:
        ValueError: With what is wrong (truncated, bad JSON, overlapping or gapped offsets...).
    """
    size = source.size_bytes
    if size < 8:
        raise ValueError(f"file has {size} bytes, fewer than the 8-byte header length")
    (length,) = struct.unpack("<Q", source.read_range(0, 8))
    if length > _MAX_HEADER or 8 + length > size:
        raise ValueError(
            f"header length {length} does not fit the file of {size} bytes (truncated?)"
        )
    raw = source.read_range(8, 8 + length)
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except ValueError as e:
        raise ValueError(f"header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("__metadata__ must map strings to strings")
    data_start = 8 + length
    spans = []
    entries: SafetensorsHeader = {}
    for name, entry in header.items():
        try:
            dtype = from_safetensors_code(entry["dtype"])
            shape = [int(s) for s in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tensor '{name}': malformed entry {entry!r}") from e
        want = math.prod(shape) * dtype.itemsize
        if end - begin != want:
            raise ValueError(
                f"tensor '{name}': data_offsets span {end - begin} bytes but {dtype.name}{shape} needs {want}"
            )
        spans.append((begin, end, name))
        entries[name] = StoredEntry(str(entry["dtype"]), tuple(shape), (begin, end))
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            kind = (
                "overlaps the previous tensor"
                if begin < pos
                else f"leaves a gap of {begin - pos} bytes"
            )
            raise ValueError(f"tensor '{name}' at byte {begin} {kind}")
        pos = end
    if data_start + pos != size:
        if data_start + pos > size:
            raise ValueError(
                f"data should end at byte {data_start + pos} but the file has {size} bytes (truncated)"
            )
        raise ValueError(f"{size - data_start - pos} unexpected bytes after the last tensor")
    return entries, metadata, data_start


class _LibraryReader:
    """The `safetensors` library's own reading of one file, for the spot checks.

    It reads through numpy (with `ml_dtypes` for bfloat16 and the float8 types), so a verify
    never imports torch; a tensor whose dtype numpy cannot hold is read through torch instead.
    """

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        with contextlib.suppress(ImportError):
            import ml_dtypes  # noqa: F401 - registers bfloat16 and float8 with numpy

        self._path = path
        self.handle: Any = safe_open(path, framework="np")  # raises on invalid files
        self._torch: Any = None

    def first_row(self, tensor: str, shape: list[int]) -> bytes:
        """The bytes of the tensor's first row (all of it, for a scalar), as the library reads them."""
        try:
            return _first_row_bytes(self.handle, tensor, shape)
        except (TypeError, AttributeError):  # a dtype numpy does not know (safetensors asks
            # numpy for `np.float8_e4m3fn`, which it lacks: AttributeError)
            with contextlib.suppress(TypeError, AttributeError, ImportError):
                with _numpy_float8_names():
                    return _first_row_bytes(self.handle, tensor, shape)
            if self._torch is None:
                from safetensors import safe_open

                self._torch = safe_open(self._path, framework="pt")
            return _first_row_bytes(self._torch, tensor, shape)


_FLOAT8_NAMES = ("float8_e4m3fn", "float8_e5m2")
_numpy_names_lock = threading.Lock()


@contextlib.contextmanager
def _numpy_float8_names() -> Iterator[None]:
    """While the block runs, numpy's module has the names of `ml_dtypes`' float8 types it
    lacks, which is where the safetensors library looks for them (`numpy.float8_e4m3fn`), so
    it reads an FP8 weight (`--quantize`) through numpy; they are removed after. Importing
    torch to read one row instead cost a quantized 0.5B conversion 1.8 CPU-seconds (8 s
    of wall time on the loaded 2-core machine). One reader at a time (a lock)."""
    import ml_dtypes
    import numpy as np

    with _numpy_names_lock:
        added = [n for n in _FLOAT8_NAMES if n not in vars(np) and hasattr(ml_dtypes, n)]
        for name in added:
            setattr(np, name, getattr(ml_dtypes, name))
        try:
            yield
        finally:
            for name in added:
                delattr(np, name)


def _first_row_bytes(handle: Any, tensor: str, shape: list[int]) -> bytes:
    lib = handle.get_tensor(tensor) if not shape else handle.get_slice(tensor)[0:1]
    if hasattr(lib, "numpy"):  # a torch tensor
        import torch

        return bytes(lib.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    import numpy as np

    return bytes(np.ascontiguousarray(lib).tobytes())


def _library_check(
    url: str, header: SafetensorsHeader, metadata: dict[str, str]
) -> tuple[list[str], _LibraryReader]:
    """Open the file with the `safetensors` library; report any disagreement with our parse."""
    problems = []
    reader = _LibraryReader(local_path(url))
    handle = reader.handle
    if set(handle.keys()) != set(header):
        problems.append(f"safetensors lists {sorted(set(handle.keys()) ^ set(header))} differently")
    if (handle.metadata() or {}) != metadata:
        problems.append("safetensors reads different __metadata__")
    return problems, reader


_EXPONENT_BITS = {
    # dtype -> (unsigned view, exponent field): NaN and +-Inf are the values whose exponent
    # bits are all ones (IEEE 754; bfloat16 is float32's top half)
    "float16": ("uint16", 0x7C00),
    "bfloat16": ("uint16", 0x7F80),
    "float32": ("uint32", 0x7F800000),
    "float64": ("uint64", 0x7FF0000000000000),
}
_MASK_BLOCK_BYTES = 512 * 2**10
"""Bytes the exponent scan takes at once, so they stay in a core's L2. Over 256 MB of
bfloat16 here (with a masked copy, before `_nonfinite_in`), 512 KB blocks scanned at 7.0-8.3
GB/s, 2 MB blocks at 5.8-6.6, and 64 KB at 4.9-6.0 (more numpy calls)."""
_VERIFY_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Tensors hashed at once (xxhash and hashlib release the GIL); each holds one chunk buffer."""


def _nonfinite_in(bits: Any, exponent: int) -> bool:
    """Whether any of `bits` (floats' bits as unsigned integers, a numpy array) has an all-ones
    exponent: read as signed integers, a positive NaN or Inf is at least `exponent`; read as
    unsigned, a negative one is at least the sign bit plus `exponent`. Two read-only passes:
    masking into a scratch block first ran at 26 GB/s over 512 KB of bfloat16 in L2, this at 46.
    """
    if len(bits) == 0:
        return False
    sign = 1 << (8 * bits.itemsize - 1)
    signed = bits.view(bits.dtype.str.replace("u", "i"))
    return bool(signed.max() >= exponent) or bool(bits.max() >= sign | exponent)


def _any_nonfinite(view: memoryview, dtype_name: str, digests: Sequence[Digest] = ()) -> bool:
    """Whether any value has an all-ones exponent: integer passes in numpy blocks of
    `_MASK_BLOCK_BYTES`. `digests` are fed each block first, so that the scan reads it while
    the hash has just left it in cache, where a chunk hashed whole first is read from memory
    twice (verifying 1 GB of bfloat16 on one core: 0.27-0.28 CPU-seconds before, 0.23-0.25
    after); without them the scan stops at the first block that has one.

    numpy releases the GIL and uses no thread pool; torch's `isnan` on bfloat16 ran at about
    0.1 GB/s here, which made verification the slowest stage of a conversion.
    """
    import numpy as np

    kind, exponent = _EXPONENT_BITS[dtype_name]
    bits = np.frombuffer(view, dtype=kind)
    block = _MASK_BLOCK_BYTES // bits.itemsize
    found = False
    for i in range(0, len(bits), block):
        part = bits[i : i + block]
        for d in digests:
            d.update(part)
        found = found or _nonfinite_in(part, exponent)
        if found and not digests:
            return True
    return found


def _hash_and_count(
    view: memoryview, dtype_name: str, digests: Sequence[Digest]
) -> tuple[int, int, int]:
    """Feed `view` to `digests` and count its NaN, +Inf and -Inf values (exact; torch counts
    only when the block scan, `_any_nonfinite`, finds some)."""
    if not _any_nonfinite(view, dtype_name, digests):
        return 0, 0, 0
    import torch

    t = torch.frombuffer(view, dtype=torch_dtype(dtype_name))
    nan = int(torch.isnan(t).sum())
    posinf = int(torch.isposinf(t).sum())
    neginf = int(torch.isneginf(t).sum())
    return nan, posinf, neginf


def _count_nonfinite(view: memoryview, dtype_name: str) -> tuple[int, int, int]:
    """NaN, +Inf and -Inf counts of one chunk (`_hash_and_count`, hashing nothing)."""
    return _hash_and_count(view, dtype_name, ())


@dataclass(frozen=True, slots=True)
class _TensorScan:
    algorithm: str
    digest: str
    nan: int
    posinf: int
    neginf: int
    first: bytes
    """The tensor's first bytes (up to 4096), for the spot check."""


def _scan_tensor(
    source: ByteSource,
    start: int,
    end: int,
    dtype_name: str,
    itemsize: int,
    buf: Any,
    algorithm: str = TENSOR_CHECKSUM,
    file_digest: Digest | None = None,
) -> _TensorScan:
    """Hash bytes `[start, end)` of `source` and count non-finite values, a chunk at a time;
    `file_digest` (the whole file's SHA-256, fed in file order) gets the same chunks."""
    digest = new_digest(algorithm)
    nan = posinf = neginf = 0
    chunk_bytes = len(buf)
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    count = dtype_name in _EXPONENT_BITS
    first = b""
    view_range = getattr(source, "view_range", None)  # a mapped file: no copy into `buf`
    pos = start
    while pos < end:
        n = min(step, end - pos)
        if view_range is not None:
            view = view_range(pos, n)
        else:
            view = memoryview(buf)[:n]
            source.readinto_at(pos, view)
        if pos == start:
            first = bytes(view[: min(n, 4096)])
        digests = [digest] if file_digest is None else [digest, file_digest]
        if count:
            a, b, c = _hash_and_count(view, dtype_name, digests)
            nan, posinf, neginf = nan + a, posinf + b, neginf + c
        else:
            for d in digests:
                d.update(view)
        pos += n
    return _TensorScan(algorithm, digest.hexdigest(), nan, posinf, neginf, first)


def verify_shard(
    storage: Storage,
    url: str,
    *,
    expected: dict[str, dict[str, Any]] | None = None,
    allow_nonfinite: bool = False,
    chunk_bytes: int = 16 * 2**20,
    on_bytes: Callable[[int], None] | None = None,
    file_sha256: bool = False,
) -> ShardReport:
    """Check one safetensors file.

    Args:
        url: The file.
        expected: name -> {checksum, dtype, shape} the file must hold exactly (the manifest's
            or the merge's record; the checksum under its algorithm's name, `xxh3_128` or
            `sha256`), or None to check structure and values only.
        allow_nonfinite: Pass NaN/Inf values instead of failing (they are counted either way).
        chunk_bytes: Bytes read at a time.
        file_sha256: Also hash every byte of the file, in order, into one SHA-256
            (`ShardReport.sha256`). The tensors are then scanned one after another in this
            thread, so each byte is read and hashed once; off, they are scanned in parallel.
    """
    pin_mmap_threshold()
    name = url.rsplit("/", 1)[-1]
    report = ShardReport(file=name)
    try:
        source = map_source(storage.open_source(url), storage.counter)
    except Exception as e:
        report.failures.append(Failure(name, "*", "readable", str(e)))
        return report
    try:
        try:
            header, metadata, data_start = parse_safetensors_header(source)
        except ValueError as e:
            report.failures.append(Failure(name, "*", "header", str(e)))
            return report
        report.metadata = metadata
        if any(e.dtype == "F8_E4M3" or n.endswith("_packed") for n, e in header.items()):
            from zerosafe.verify.quantized import check_quantized

            problems, report.quantized = check_quantized(source, data_start, header)
            report.failures.extend(Failure(name, t, "scales", d) for t, d in problems)
        handle = _library_handle(url, header, metadata, report) if is_local(url) else None
        ordered = sorted(header.items(), key=lambda kv: kv[1].data_offsets[0])
        file_digest: Digest | None = None
        if file_sha256:
            # The header as stored (length prefix, JSON, padding), then the data region: the
            # parser checked that the tensors tile it with no gap, so this is every byte.
            file_digest = hashlib.sha256(source.read_range(0, data_start))
        for (tensor, entry), scanned in _scan_in_order(
            source, data_start, ordered, expected, chunk_bytes, file_digest
        ):
            _record_tensor(report, tensor, entry, scanned, handle, allow_nonfinite)
            begin, end = entry.data_offsets
            if on_bytes is not None and end > begin:
                on_bytes(end - begin)
        if file_digest is not None:
            report.sha256 = file_digest.hexdigest()
        if expected is not None:
            _compare_expected(report, expected, name)
    finally:
        source.close()
    log.info(
        "verify %s: %d tensors, %d bytes read, %s",
        name, len(report.tensors), report.bytes_read,
        f"{len(report.failures)} check(s) failed" if report.failures else "ok",
    )  # fmt: skip
    return report


def _library_handle(
    url: str, header: SafetensorsHeader, metadata: dict[str, str], report: ShardReport
) -> _LibraryReader | None:
    """The `safetensors` library's own view of a local file (for the spot checks), its
    complaints recorded as header failures."""
    try:
        problems, handle = _library_check(url, header, metadata)
    except Exception as e:
        report.failures.append(
            Failure(report.file, "*", "header", f"safetensors cannot open it: {e}")
        )
        return None
    report.failures.extend(Failure(report.file, "*", "header", p) for p in problems)
    return handle


def _scan_in_order(
    source: Any,
    data_start: int,
    ordered: list[tuple[str, StoredEntry]],
    expected: dict[str, dict[str, Any]] | None,
    chunk_bytes: int,
    file_digest: Digest | None = None,
) -> Iterator[tuple[tuple[str, StoredEntry], _TensorScan]]:
    """Every tensor's checksum and non-finite counts, hashed in parallel and yielded in file
    order, as a serial scan would. With `file_digest`, one tensor after another in this
    thread instead: the whole file's hash needs its bytes in order."""
    workers = 1 if file_digest is not None else max(1, min(_VERIFY_THREADS, len(ordered)))
    buffers: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for _ in range(workers):
        buffers.put(allocate_buffer(chunk_bytes))

    def scan(tensor: str, entry: StoredEntry) -> _TensorScan:
        dtype = from_safetensors_code(entry.dtype)
        begin, end = entry.data_offsets
        # The algorithm the record names (SHA-256 in outputs of earlier versions).
        recorded = recorded_checksum((expected or {}).get(tensor) or {})
        buf = buffers.get()
        try:
            return _scan_tensor(
                source, data_start + begin, data_start + end, dtype.name, dtype.itemsize, buf,
                recorded[0] if recorded else TENSOR_CHECKSUM, file_digest,
            )  # fmt: skip
        finally:
            buffers.put(buf)

    if file_digest is not None:
        for tensor, entry in ordered:
            yield (tensor, entry), scan(tensor, entry)
        return

    with ThreadPoolExecutor(workers, thread_name_prefix="zerosafe-verify") as pool:
        futures = [pool.submit(scan, tensor, entry) for tensor, entry in ordered]
        try:
            for item, future in zip(ordered, futures, strict=True):
                yield item, future.result()
        finally:
            for future in futures:
                future.cancel()


def _record_tensor(
    report: ShardReport,
    tensor: str,
    entry: StoredEntry,
    scanned: _TensorScan,
    handle: Any,
    allow_nonfinite: bool,
) -> None:
    dtype = from_safetensors_code(entry.dtype)
    begin, end = entry.data_offsets
    nan, posinf, neginf = scanned.nan, scanned.posinf, scanned.neginf
    report.bytes_read += end - begin
    report.tensors[tensor] = {
        "dtype": dtype.name,
        "shape": list(entry.shape),
        scanned.algorithm: scanned.digest,
        "nan": nan,
        "posinf": posinf,
        "neginf": neginf,
    }
    if handle is not None and end > begin:
        _spot_check(handle, tensor, list(entry.shape), scanned.first, report, report.file)
    if not allow_nonfinite and (nan or posinf or neginf):
        detail = f"{nan} NaN, {posinf} +Inf, {neginf} -Inf"
        if dtype.name == "float16" and (posinf or neginf):
            detail += " (float16 overflow: values beyond +-65504 become Inf when cast to fp16; use --dtype bf16 or fp32)"
        report.failures.append(Failure(report.file, tensor, "finite", detail))


def _spot_check(
    reader: _LibraryReader,
    tensor: str,
    shape: list[int],
    first: bytes,
    report: ShardReport,
    name: str,
) -> None:
    """The library's reading of the tensor's first row must equal the raw bytes we hashed."""
    try:
        raw = reader.first_row(tensor, shape)
    except Exception as e:
        report.failures.append(Failure(name, tensor, "header", f"safetensors cannot read it: {e}"))
        return
    n = min(len(raw), len(first))
    if raw[:n] != first[:n]:
        report.failures.append(
            Failure(name, tensor, "data", "safetensors reads different bytes than the header says")
        )


def _compare_expected(report: ShardReport, expected: dict[str, dict[str, Any]], name: str) -> None:
    for tensor, want in expected.items():
        got = report.tensors.get(tensor)
        if got is None:
            report.failures.append(Failure(name, tensor, "present", "missing from the file"))
            continue
        if "dtype" in want and got["dtype"] != want["dtype"]:
            report.failures.append(
                Failure(name, tensor, "dtype", f"{got['dtype']}, expected {want['dtype']}")
            )
        if "shape" in want and list(got["shape"]) != list(want["shape"]):
            report.failures.append(
                Failure(name, tensor, "shape", f"{got['shape']}, expected {want['shape']}")
            )
        recorded = recorded_checksum(want)
        if recorded is not None and got.get(recorded[0]) != recorded[1]:
            algorithm, digest = recorded
            report.failures.append(
                Failure(
                    name,
                    tensor,
                    "checksum",
                    f"{algorithm} {str(got.get(algorithm))[:16]}..., recorded {digest[:16]}...",
                )
            )
    for tensor in report.tensors:
        if tensor not in expected:
            report.failures.append(Failure(name, tensor, "present", "not expected in this file"))
