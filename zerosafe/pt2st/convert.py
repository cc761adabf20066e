"""Convert any `torch.save` zip file (a state dict, a training checkpoint) into one safetensors
file, streaming, with the structure in the metadata; and check such a file.

The input is read with the same lazy, code-free reader as the ZeRO path
(`zerosafe.formats.torch_zip`): only the pickle is parsed, and each storage's bytes are copied in
chunks by the bounded-memory pipeline (`zerosafe.stages.streaming.copy_stream`), so memory stays
within the budget whatever the size of the file or of its largest tensor.

On-disk layout (format version 1; safetensors: https://github.com/huggingface/safetensors):

- One safetensors entry per torch *storage*, stored once however many tensors view it.
  Where a tensor is exactly its whole storage (offset 0, contiguous strides, same size: every
  tensor of a plain state dict), the entry is that tensor, named by its path (`tree.py`), so
  `safetensors.torch.load_file` gives the usual state dict. Otherwise the entry is the raw
  storage, 1-D in its tensors' dtype (`uint8` if they disagree), named `@storage/<path of the
  first tensor that views it>`.
- `__metadata__`: `format` = `pt`; `zerosafe.pt2st` = the format version;
  `zerosafe.pt2st.source_bytes` and `zerosafe.pt2st.source_version` = the size and mtime (or
  ETag) of the `.pt` it came from (so a re-run or a resume can tell a stale conversion);
  `zerosafe.pt2st.tree` = the JSON document of `tree.py`, in which each tensor is a node
  `{"tensor": <entry>}` when it is its entry as stored, else `{"tensor": <entry>, "dtype",
  "offset", "shape", "stride"}` (offset and strides in elements of the tensor's dtype), plus
  `"parameter": true` for an `nn.Parameter` and `"requires_grad": true` where the pickle said
  so (an `nn.Parameter` loads back as a parameter with that flag).
- Entries are laid out by element size, largest first, so every entry of a memory-mapped file
  is aligned for its dtype.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickletools
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerosafe.config import DEFAULT_MEMORY_BYTES, ConvertOptions
from zerosafe.dtypes import DTYPES, dtype_info, from_safetensors_code
from zerosafe.errors import (
    CheckpointFormatError,
    ConfigError,
    IntegrityError,
    OutputExistsError,
    UnsafePickleError,
    UnsupportedCheckpointError,
    VerificationError,
)
from zerosafe.formats.crc import CrcLedger
from zerosafe.formats.safetensors import (
    HeaderEntry,
    SafetensorsStreamWriter,
    read_entries,
    read_header,
)
from zerosafe.formats.torch_legacy import open_torch_file
from zerosafe.formats.torch_zip import (
    ALLOWED_GLOBALS,
    TensorRecord,
    TorchZipFile,
    contiguous_stride,
)
from zerosafe.io.storage import ByteSource, Storage, is_local, local_path
from zerosafe.pt2st.tree import (
    TensorSite,
    decode_tree,
    dumps_tree,
    encode_tree,
    entry_name,
    format_path,
)
from zerosafe.stages.streaming import CopyJob, copy_stream

__all__ = [
    "FORMAT_VERSION",
    "META_SOURCE_BYTES",
    "META_SOURCE_VERSION",
    "META_TREE",
    "META_VERSION",
    "STORAGE_PREFIX",
    "EntryPlan",
    "PtPlan",
    "convert_pt",
    "current_output",
    "inspect_pt",
    "list_pt_globals",
    "load_pt_records",
    "open_pt",
    "plan_pt",
    "safetensors_path_for",
    "verify_pt",
    "view_end_bytes",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = "1"
META_VERSION = "zerosafe.pt2st"
META_TREE = "zerosafe.pt2st.tree"
META_SOURCE_BYTES = "zerosafe.pt2st.source_bytes"
META_SOURCE_VERSION = "zerosafe.pt2st.source_version"
STORAGE_PREFIX = "@storage/"
_MAX_HEADER_BYTES = 100_000_000  # the safetensors reference reader's limit
_INT64_MAX = 2**63 - 1  # torch sizes, strides and offsets are int64
_VERIFY_CHUNK_BYTES = 8 * 2**20
_PT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


@dataclass(frozen=True, kw_only=True, slots=True)
class EntryPlan:
    """One safetensors entry: the bytes of one storage of the source."""

    name: str
    storage_key: str
    """The storage's key in the zip (`<archive>/data/<key>`)."""
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PtPlan:
    """What the output holds: entries in file order and the `__metadata__`."""

    entries: tuple[EntryPlan, ...]
    metadata: dict[str, str]
    num_tensors: int
    num_views: int
    """Tensors stored as views of an entry (shared storages, slices, transposes)."""
    globals_found: tuple[str, ...]

    @property
    def data_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def safetensors_path_for(path: str) -> str:
    """Where `zerosafe pt2st` output for `path` is looked for: `x.pt` -> `x.safetensors`."""
    root, ext = posixpath.splitext(path)
    return (root if ext in _PT_SUFFIXES else path) + ".safetensors"


def view_end_bytes(shape: list[int], stride: list[int], offset: int, itemsize: int) -> int:
    """Bytes of storage a view needs: one past its last element (0 for an empty view)."""
    if not all(shape):
        return 0
    span = sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    return (offset + span + 1) * itemsize


# -- reading the source ---------------------------------------------------------------------


def open_pt(storage: Storage, source: str) -> ByteSource:
    """Open the `.pt` file, refusing a folder with the command that converts one."""
    if is_local(source) and os.path.isdir(local_path(source)):
        raise CheckpointFormatError(
            f"{source}: is a folder; pt2st converts one file written by torch.save. For a "
            "DeepSpeed checkpoint folder use `zerosafe convert`."
        )
    return storage.open_source(source)


def _check_not_source(storage: Storage, source: str, destination: str) -> None:
    """Refuse an output that is the input, however spelled (`x.pt`, `./x.pt`, a symbolic or
    hard link): writing it would replace the file being read."""
    same = storage.canonical_url(source) == storage.canonical_url(destination)
    if not same and is_local(source) and is_local(destination):
        with contextlib.suppress(OSError):
            same = os.path.samefile(local_path(source), local_path(destination))
    if same:
        raise ConfigError(
            f"{destination}: is the input file '{source}' itself; give another output, e.g. "
            f"'{safetensors_path_for(source)}'"
        )
    if is_local(destination) and os.path.isdir(local_path(destination)):
        raise ConfigError(
            f"{destination}: is a folder; the output is one file, e.g. "
            f"'{posixpath.join(destination, posixpath.basename(safetensors_path_for(source)))}'"
        )


def _pickle_globals(data: bytes, url: str) -> list[str]:
    """Every global a pickle names, read opcode by opcode (nothing is unpickled or run)."""
    found: list[str] = []
    memo: dict[int, Any] = {}
    pushed: list[Any] = []  # what recent opcodes pushed: enough to resolve STACK_GLOBAL
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                found.append(f"{module}.{attr}")
            elif name == "STACK_GLOBAL":
                top = pushed[-2:]
                found.append(
                    f"{top[0]}.{top[1]}"
                    if len(top) == 2 and all(isinstance(x, str) for x in top)
                    else "<unresolved STACK_GLOBAL>"
                )
            if name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(str(arg))] = pushed[-1] if pushed else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                pushed.append(memo.get(int(str(arg))))
            elif isinstance(arg, str) and ("UNICODE" in name or "STRING" in name):
                pushed.append(arg)
            else:
                pushed.append(None)
            del pushed[:-4]
    except ValueError as e:
        raise CheckpointFormatError(f"{url}: the pickle is damaged: {e}") from e
    return sorted(set(found))


def list_pt_globals(zf: TorchZipFile) -> list[dict[str, Any]]:
    """The globals a torch file's pickle names, each with whether zerosafe allows it.

    Reads the pickle's opcodes only: nothing is unpickled, so this works on files the
    converter refuses, to see why.
    """
    data = zf.read_record(zf.records[zf.prefix + "data.pkl"])
    return [{"global": g, "allowed": g in ALLOWED_GLOBALS} for g in _pickle_globals(data, zf.url)]


def load_pt_records(zf: TorchZipFile) -> Any:
    """Unpickle a torch file into containers and lazy `TensorRecord`s, without running code.

    Raises:
        UnsafePickleError: Naming every global outside the allowlist (not only the first).
        CheckpointFormatError: If the pickle or the archive is damaged.
    """
    try:
        return zf.load()
    except UnsafePickleError as e:
        refused = [g["global"] for g in list_pt_globals(zf) if not g["allowed"]]
        names = ", ".join(f"'{g}'" for g in refused) or str(e)
        raise UnsafePickleError(
            f"{zf.url}: the pickle names globals outside zerosafe's allowlist: {names}. Nothing "
            "was loaded (loading them could run code). `zerosafe pt2st --list-globals` lists "
            "every global the file names; if these are harmless, report them so they can be "
            "added to ALLOWED_GLOBALS in zerosafe/formats/torch_zip.py, or save only the state dict."
        ) from e


# -- planning -------------------------------------------------------------------------------


def _check_dtype(url: str, site: TensorSite) -> None:
    info = DTYPES.get(site.record.dtype)
    if info is None or info.safetensors_code is None:
        storable = ", ".join(d for d, i in DTYPES.items() if i.safetensors_code)
        raise UnsupportedCheckpointError(
            f"{url}: the tensor at {format_path(site.path)} has dtype '{site.record.dtype}', "
            f"which safetensors cannot hold (it holds {storable}); convert that tensor (for "
            "example view complex128 as float64) before saving"
        )


def _check_view(url: str, site: TensorSite, storage_bytes: int) -> None:
    """Refuse a tensor record that no torch tensor can be: the file would load as something
    else or fail to load, so nothing is written (torch.save never writes one)."""
    rec = site.record
    where = f"{url}: the tensor at {format_path(site.path)}"
    corrupt = "the file is corrupt or was not written by torch.save"
    if len(rec.stride) != len(rec.shape):
        raise CheckpointFormatError(
            f"{where} has shape {list(rec.shape)} but strides {list(rec.stride)} (one per "
            f"dimension expected); {corrupt}"
        )
    if any(v < 0 or v > _INT64_MAX for v in (*rec.shape, *rec.stride, rec.storage_offset)):
        raise CheckpointFormatError(
            f"{where} has shape {list(rec.shape)}, strides {list(rec.stride)}, offset "
            f"{rec.storage_offset}, expected each between 0 and 2**63-1; {corrupt}"
        )
    if rec.numel > _INT64_MAX:
        raise CheckpointFormatError(
            f"{where} has shape {list(rec.shape)}, {rec.numel} elements (torch holds at most "
            f"2**63-1); {corrupt}"
        )
    end = view_end_bytes(list(rec.shape), list(rec.stride), rec.storage_offset, rec.itemsize)
    end = max(end, rec.storage_offset * rec.itemsize)
    if end > storage_bytes:
        raise CheckpointFormatError(
            f"{where} (shape {list(rec.shape)}, strides {list(rec.stride)}, offset "
            f"{rec.storage_offset}, {rec.dtype}) reaches byte {end} of storage "
            f"'{rec.storage.key}', which holds {storage_bytes} bytes; {corrupt}"
        )
    if rec.requires_grad and not dtype_info(rec.dtype).is_floating:
        raise CheckpointFormatError(
            f"{where} is {rec.dtype} with requires_grad set, which torch allows only for "
            f"floating tensors (it would fail to load); {corrupt}"
        )


def _is_whole(record: TensorRecord, storage_bytes: int) -> bool:
    return (
        record.storage_offset == 0
        and record.nbytes == storage_bytes
        and record.stride == contiguous_stride(record.shape)
    )


def _same_view(a: TensorRecord, b: TensorRecord) -> bool:
    return (a.dtype, a.storage_offset, a.shape, a.stride) == (
        b.dtype,
        b.storage_offset,
        b.shape,
        b.stride,
    )


def plan_pt(zf: TorchZipFile, obj: Any, *, source_version: str | None = None) -> PtPlan:
    """Decide the entries and the metadata for the object `load_pt_records` returned.

    Args:
        zf: The source file.
        obj: What `load_pt_records(zf)` returned.
        source_version: The source's mtime or ETag, recorded so a re-run can tell that the
            output already holds this very source.

    Raises:
        UnsupportedCheckpointError: For a dtype safetensors cannot hold or a value JSON cannot
            hold exactly (the message names its path).
    """
    try:
        doc, sites = encode_tree(obj)
    except UnsupportedCheckpointError as e:
        raise UnsupportedCheckpointError(f"{zf.url}: {e}") from e
    except RecursionError as e:
        raise UnsupportedCheckpointError(
            f"{zf.url}: the saved object is nested too deeply to write as JSON; save a flatter "
            "structure (a dict of tensors)"
        ) from e
    groups: dict[str, list[TensorSite]] = {}
    for site in sites:
        _check_dtype(zf.url, site)
        groups.setdefault(site.record.storage.key, []).append(site)
    entries = []
    num_views = 0
    for key, group in groups.items():
        ref = group[0].record.storage
        storage_bytes = ref.numel * dtype_info(ref.dtype).itemsize
        for site in group:
            _check_view(zf.url, site, storage_bytes)
        whole = next((s.record for s in group if _is_whole(s.record, storage_bytes)), None)
        if whole is not None:
            name = entry_name(next(s.path for s in group if s.record is whole))
            dtype, shape = whole.dtype, whole.shape
        else:
            dtypes = {s.record.dtype for s in group}
            dtype = dtypes.pop() if len(dtypes) == 1 else "uint8"
            if storage_bytes % dtype_info(dtype).itemsize:
                dtype = "uint8"
            name = STORAGE_PREFIX + entry_name(group[0].path)
            shape = (storage_bytes // dtype_info(dtype).itemsize,)
        entries.append(
            EntryPlan(name=name, storage_key=key, dtype=dtype, shape=shape, nbytes=storage_bytes)
        )
        for site in group:
            rec = site.record
            if whole is not None and _same_view(rec, whole):
                site.node["tensor"] = name
            else:
                num_views += 1
                site.node.update(
                    tensor=name,
                    dtype=rec.dtype,
                    offset=rec.storage_offset,
                    shape=list(rec.shape),
                    stride=list(rec.stride),
                )
            if rec.is_parameter:
                site.node["parameter"] = True
            if rec.requires_grad:
                site.node["requires_grad"] = True
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        # Keys that differ but encode alike (two NaN float keys): the header would hold one
        # name twice, which safetensors refuses to load.
        dup = next(n for n in names if names.count(n) > 1)
        raise UnsupportedCheckpointError(
            f"{zf.url}: two tensors get the same entry name '{dup}' (their keys differ but "
            "encode alike, e.g. NaN keys); give them distinct keys before saving"
        )
    # Largest elements first: every entry then starts aligned for its dtype (sizes are
    # multiples of the element size), which zero-copy loads from a memory map rely on.
    entries.sort(key=lambda e: -dtype_info(e.dtype).itemsize)
    metadata = {
        "format": "pt",
        META_VERSION: FORMAT_VERSION,
        META_SOURCE_BYTES: str(zf.source.size_bytes),
        **({META_SOURCE_VERSION: source_version} if source_version else {}),
        META_TREE: dumps_tree(doc),
    }
    if len(metadata[META_TREE]) > _MAX_HEADER_BYTES // 2:
        raise UnsupportedCheckpointError(
            f"{zf.url}: the structure takes {len(metadata[META_TREE])} bytes of JSON, more than "
            "a safetensors header can hold; split the checkpoint (e.g. save the model and the "
            "optimizer state separately)"
        )
    return PtPlan(
        entries=tuple(entries),
        metadata=metadata,
        num_tensors=len(sites),
        num_views=num_views,
        globals_found=tuple(sorted(zf.globals_found)),
    )


def _chunk_bytes(memory: int) -> int:
    # One copy task, sized the way the ZeRO path sizes its tasks (validates the budget).
    return ConvertOptions(memory=memory, max_parallel_tasks=1).chunk_bytes


def _plan_summary(url: str, source_bytes: int, plan: PtPlan) -> dict[str, Any]:
    dtypes: dict[str, int] = {}
    for e in plan.entries:
        dtypes[e.dtype] = dtypes.get(e.dtype, 0) + e.nbytes
    return {
        "source": url,
        "source_bytes": source_bytes,
        "num_tensors": plan.num_tensors,
        "num_entries": len(plan.entries),
        "num_views": plan.num_views,
        "data_bytes": plan.data_bytes,
        "largest_entry_bytes": max((e.nbytes for e in plan.entries), default=0),
        "bytes_by_dtype": dtypes,
        "metadata_bytes": len(plan.metadata[META_TREE]),
        "globals": list(plan.globals_found),
    }


def inspect_pt(source: str, *, storage: Storage | None = None) -> dict[str, Any]:
    """Read a torch file's pickle (not its tensors) and say what converting it gives.

    Refuses, before any byte is written, what `convert_pt` would refuse.

    Returns:
        A JSON-able summary: tensor, entry and view counts, bytes, globals found.
    """
    storage = storage or Storage()
    src = open_pt(storage, source)
    try:
        zf = open_torch_file(src)
        plan = plan_pt(zf, load_pt_records(zf))
        return _plan_summary(source, src.size_bytes, plan)
    finally:
        src.close()


# -- converting -----------------------------------------------------------------------------


def _check_crcs(zf: TorchZipFile, plan: PtPlan, ledger: CrcLedger) -> int:
    records = {e.storage_key: zf.storage_record(e.storage_key) for e in plan.entries}
    expected = {r.name: (r.size_bytes, r.crc32) for r in records.values() if r.has_crc}
    by_name = {r.name: r for r in records.values()}

    def read_gap(key: str, offset: int, length: int) -> bytes:
        start = zf.data_offset(by_name[key]) + offset
        return zf.source.read_range(start, start + length)

    result = ledger.check(expected, read_gap)
    if result.failed:
        detail = "; ".join(f"'{k}': {why}" for k, why in result.failed)
        raise IntegrityError(
            f"{zf.url}: {len(result.failed)} storage record(s) fail their zip CRC32 check "
            f"({detail}); the file is corrupt. Copy it again from where it was written."
        )
    return len(result.checked)


def convert_pt(
    source: str,
    destination: str,
    *,
    storage: Storage | None = None,
    memory: int = DEFAULT_MEMORY_BYTES,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Convert a `torch.save` zip file into one safetensors file, streaming.

    The output appears only when whole (temporary name plus rename, or a completed multipart
    upload), after every storage read has passed the zip's CRC32 check.

    Args:
        source: The `.pt` file (local, NFS or an fsspec URL).
        destination: The `.safetensors` file to write.
        storage: Opens both (with its storage options and byte counter).
        memory: Memory budget of the copy; chunk buffers are sized from it.
        overwrite: Replace an existing destination.
        on_bytes: Called with the bytes of each chunk copied (progress).

    Returns:
        A JSON-able summary with counts, bytes, seconds and each entry's SHA-256.

    Raises:
        OutputExistsError: If `destination` exists and `overwrite` is false.
        UnsafePickleError: If the pickle names a global outside the allowlist.
        UnsupportedCheckpointError: For a value or dtype the format cannot hold.
        IntegrityError: If a storage's bytes fail the zip CRC32.
    """
    from zerosafe.pipeline import peak_rss_bytes

    storage = storage or Storage()
    chunk_bytes = _chunk_bytes(memory)
    _check_not_source(storage, source, destination)
    src = open_pt(storage, source)
    try:
        identity = storage.identity(source)
        if not overwrite and storage.exists(destination):
            if current_output(storage, source, destination):
                return {"status": "already-complete", "source": source, "destination": destination}
            raise OutputExistsError(
                f"{destination}: already exists and was not converted from this version of "
                f"'{source}'; pass `overwrite` (--overwrite) to replace it"
            )
    except BaseException:
        src.close()
        raise
    started = time.monotonic()
    read_before = storage.counter.bytes_read
    try:
        zf = open_torch_file(src)
        plan = plan_pt(zf, load_pt_records(zf), source_version=identity.version)
        log.info(
            "%s: %d tensors in %d entries (%d views), %d bytes",
            source,
            plan.num_tensors,
            len(plan.entries),
            plan.num_views,
            plan.data_bytes,
        )
        header = [HeaderEntry(e.name, e.dtype, e.shape) for e in plan.entries]
        jobs = _copy_jobs(zf, plan, src)
        sink = storage.open_sink(destination)
        try:
            writer = SafetensorsStreamWriter(sink, header, plan.metadata)
            ledger = CrcLedger()
            copy_stream(jobs, writer, chunk_bytes=chunk_bytes, ledger=ledger, on_bytes=on_bytes)
            crc_checked = _check_crcs(zf, plan, ledger)
            writer.finish()
        except BaseException:
            sink.abort()
            raise
    finally:
        src.close()
    summary = _plan_summary(source, src.size_bytes, plan)
    summary.update(
        status="converted",
        destination=destination,
        file_bytes=writer.file_bytes,
        bytes_read=storage.counter.bytes_read - read_before,
        crc_records_checked=crc_checked,
        seconds=round(time.monotonic() - started, 3),
        peak_rss_bytes=peak_rss_bytes(),
        sha256={e.name: h for e, h in zip(plan.entries, writer.sha256, strict=True)},
    )
    return summary


def _copy_jobs(zf: TorchZipFile, plan: PtPlan, src: ByteSource) -> list[CopyJob]:
    """One byte copy per entry that holds data: its storage record's bytes, as they are."""
    jobs = []
    for index, e in enumerate(plan.entries):
        record = zf.storage_record(e.storage_key)
        if e.nbytes:
            jobs.append(
                CopyJob(
                    tensor=index,
                    source=src,
                    offset=zf.data_offset(record),
                    nbytes=e.nbytes,
                    src_dtype="uint8",
                    out_dtype="uint8",
                    crc_key=record.name,
                )
            )
    return jobs


def current_output(storage: Storage, source: str, destination: str) -> bool:
    """Whether `destination` is a pt2st output of this very version of `source` (by size and
    mtime or ETag); it says nothing about the output's bytes (`verify_pt` checks those)."""
    try:
        src = storage.open_source(destination)
    except CheckpointFormatError:
        return False
    try:
        _, metadata, _ = read_header(src)
    except CheckpointFormatError:
        return False
    finally:
        src.close()
    ident = storage.identity(source)
    return (
        metadata.get(META_VERSION) == FORMAT_VERSION
        and metadata.get(META_SOURCE_BYTES) == str(ident.size_bytes)
        and metadata.get(META_SOURCE_VERSION) == ident.version
    )


# -- verifying ------------------------------------------------------------------------------


def _hash_range(src: ByteSource, start: int, nbytes: int, buf: bytearray) -> str:
    digest = hashlib.sha256()
    view = memoryview(buf)
    pos = 0
    while pos < nbytes:
        n = min(len(buf), nbytes - pos)
        src.readinto_at(start + pos, view[:n])
        digest.update(view[:n])
        pos += n
    return digest.hexdigest()


def verify_pt(
    url: str,
    *,
    storage: Storage | None = None,
    expected_sha256: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Check a file `convert_pt` wrote: header, structure, view bounds, and entry checksums.

    The header is also read by the `safetensors` library (an independent reader) where the
    file is local. Bytes are hashed in chunks, so memory stays small.

    Args:
        url: The `.safetensors` file.
        storage: Opens it.
        expected_sha256: Entry name -> SHA-256 recorded while writing (`convert_pt`'s summary).

    Returns:
        A JSON-able report (`ok` is always true: failures raise).

    Raises:
        VerificationError: Listing every failed check.
    """
    storage = storage or Storage()
    src = storage.open_source(url)
    failures: list[dict[str, str]] = []
    try:
        entries, metadata, data_start = read_entries(src)
        if metadata.get(META_VERSION) != FORMAT_VERSION or META_TREE not in metadata:
            raise VerificationError(
                f"{url}: no zerosafe pt2st structure in the metadata (version "
                f"'{metadata.get(META_VERSION)}', expected '{FORMAT_VERSION}')"
            )
        num_tensors = 0

        def check_node(node: dict[str, Any]) -> None:
            nonlocal num_tensors
            num_tensors += 1
            entry = entries.get(node["tensor"])
            if entry is None:
                failures.append({"tensor": node["tensor"], "why": "no such entry"})
                return
            begin, end = entry.data_offsets
            dtype = node.get("dtype", from_safetensors_code(entry.dtype).name)
            shape = node.get("shape", list(entry.shape))
            stride = node.get("stride", contiguous_stride(shape))
            need = view_end_bytes(shape, stride, node.get("offset", 0), dtype_info(dtype).itemsize)
            if need > end - begin:
                failures.append({"tensor": node["tensor"], "why": "view past its entry"})

        # Objects are not rebuilt: checking needs no DeepSpeed.
        decode_tree(json.loads(metadata[META_TREE]), check_node, lambda *_: None)
        if is_local(url):
            from safetensors import safe_open

            with safe_open(local_path(url), framework="pt") as f:
                if set(f.keys()) != set(entries) or (f.metadata() or {}) != metadata:
                    failures.append({"tensor": "*", "why": "safetensors reads another header"})
        hashes = {}
        buf = bytearray(_VERIFY_CHUNK_BYTES)
        for name, entry in entries.items():
            begin, end = entry.data_offsets
            hashes[name] = _hash_range(src, data_start + begin, end - begin, buf)
            want = (expected_sha256 or {}).get(name)
            if want is not None and want != hashes[name]:
                failures.append({"tensor": name, "why": "sha256 differs from the one written"})
        if expected_sha256 is not None and set(expected_sha256) != set(entries):
            failures.append({"tensor": "*", "why": "entries differ from the ones written"})
    finally:
        src.close()
    if failures:
        detail = "; ".join(f"{f['tensor']}: {f['why']}" for f in failures[:5])
        raise VerificationError(
            f"{url}: {len(failures)} check(s) failed ({detail}); convert again", failures
        )
    return {
        "ok": True,
        "url": url,
        "num_entries": len(entries),
        "num_tensors": num_tensors,
        "data_bytes": sum(e.nbytes for e in entries.values()),
        "checksums_compared": len(expected_sha256 or {}),
    }
