"""PyTorch Distributed Checkpoint (DCP) folders as a source layout: slots and fragments.

A DCP folder (torch.distributed.checkpoint, as FSDP2, torchtitan, accelerate, Lightning and
Megatron's `torch_dist` write it) holds `.metadata` and `__{rank}_{n}.distcp` files; see
`metadata.py` for the metadata, `stored.py` for how each chunk is stored and `chunks.py` for
where its elements go. This module selects the tensors to convert, finds every chunk's stored
bytes (one slot per chunk) and cuts each chunk into fragments: runs of contiguous output
elements. Only the metadata and the chunks' own headers are read; tensor bytes never are, and
the chunks of tensors that are not selected (optimizer state, by default) are not touched.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zerosafe.errors import CheckpointFormatError, ConfigError, UnsupportedCheckpointError
from zerosafe.formats.dcp.chunks import ChunkBox, ChunkRuns, check_chunk_cover
from zerosafe.formats.dcp.metadata import DcpMetadata, StorageInfo, TensorMeta, parse_metadata
from zerosafe.formats.dcp.stored import StoredChunk, locate_chunk
from zerosafe.io.storage import ByteSource, FileIdentity, Storage, join_url
from zerosafe.plan.model import Slot, SourceFile

__all__ = [
    "FORMAT_NAME",
    "METADATA_FILE",
    "DcpLayout",
    "DcpSelection",
    "LayoutTensor",
    "TensorPiece",
    "is_dcp_checkpoint",
    "read_dcp_layout",
    "select_tensors",
]

log = logging.getLogger(__name__)

FORMAT_NAME = "PyTorch DCP"
METADATA_FILE = ".metadata"
_DISTCP_NAME = re.compile(r"__(\d+)_(\d+)\.distcp$")


@dataclass(frozen=True, kw_only=True, slots=True)
class DcpSelection:
    """Which tensors of a DCP checkpoint to convert, and how to name them.

    With neither field set: the tensors under the top-level `model` key, `model.` stripped
    (the layout of torchtitan, Lightning and `get_state_dict`), or every tensor if there is
    no `model` key.
    """

    select: tuple[str, ...] = ()
    """Key prefixes to convert (`model`, `model.layers.0`); a prefix matches whole dotted
    components. Empty: the default above."""
    strip_prefix: str | None = None
    """A prefix removed from the output names (`model`); None: the default's, or none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorPiece:
    """The part of an output tensor one chunk holds: runs of `slot`'s elements."""

    slot: int
    runs: ChunkRuns


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutTensor:
    """One output tensor: what it is and where its elements come from."""

    name: str
    """The output name (after `strip_prefix`)."""
    fqn: str
    """Its key in the checkpoint."""
    shape: tuple[int, ...]
    dtype: str
    role: str
    pieces: tuple[TensorPiece, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def fragments(self) -> np.ndarray:
        """`(slot, src_element_offset, numel, dst_element_offset)` rows, int64, by destination."""
        blocks = []
        for piece in self.pieces:
            r = piece.runs
            block = np.empty((r.count, 4), dtype=np.int64)
            block[:, 0] = piece.slot
            block[:, 1] = np.arange(r.count, dtype=np.int64) * r.run_numel
            block[:, 2] = r.run_numel
            block[:, 3] = r.dst_offsets
            blocks.append(block)
        rows = np.concatenate(blocks) if blocks else np.zeros((0, 4), dtype=np.int64)
        return rows[np.argsort(rows[:, 3], kind="stable")]


@dataclass(frozen=True, kw_only=True, slots=True)
class DcpLayout:
    """Everything a planner needs from a DCP checkpoint."""

    url: str
    files: tuple[SourceFile, ...]
    """The `.distcp` files that hold selected chunks."""
    slots: tuple[Slot, ...]
    """One per stored, non-empty chunk of a selected tensor."""
    tensors: tuple[LayoutTensor, ...]
    """In the checkpoint's order."""
    aliases: dict[str, str] = field(default_factory=dict)
    non_tensor_entries: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    source: dict[str, Any] = field(default_factory=dict)
    identity: tuple[dict[str, Any], ...] = ()
    """URL, size and version of `.metadata` and of every file read: the job's source identity."""


def is_dcp_checkpoint(url: str, storage: Storage) -> bool:
    """Whether `url` is a DCP checkpoint folder (it has a `.metadata` file)."""
    return storage.exists(join_url(url, METADATA_FILE))


def _matches(fqn: str, prefix: str) -> bool:
    prefix = prefix.rstrip(".")
    return prefix == "" or fqn == prefix or fqn.startswith(prefix + ".")


def select_tensors(
    keys: Sequence[str], selection: DcpSelection, *, where: str = ""
) -> list[tuple[str, str]]:
    """`(fqn, output name)` of the keys to convert, in the order given.

    Raises:
        ConfigError: If the selection matches nothing, or two keys get the same output name.
    """
    select = selection.select
    strip = selection.strip_prefix
    if not select:
        has_model = any(_matches(k, "model") and k != "model" for k in keys)
        select = ("model",) if has_model else ("",)
        if strip is None and has_model:
            strip = "model"
    chosen = [k for k in keys if any(_matches(k, p) for p in select)]
    if not chosen:
        tops = sorted({k.split(".", 1)[0] for k in keys})
        raise ConfigError(
            f"{where}: no tensor matches `select` {list(select)}; the checkpoint's top-level "
            f"keys are {tops[:20]}. Pass --select with one of them."
        )
    out: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    for fqn in chosen:
        name = fqn
        if strip and _matches(fqn, strip) and fqn != strip.rstrip("."):
            name = fqn[len(strip.rstrip(".")) + 1 :]
        if name in seen:
            raise ConfigError(
                f"{where}: '{seen[name]}' and '{fqn}' both become '{name}' after stripping "
                f"'{strip}'; select fewer keys or strip another prefix"
            )
        seen[name] = fqn
        out.append((fqn, name))
    return out


def _storage_of(meta: DcpMetadata, tensor: TensorMeta, offsets: tuple[int, ...]) -> StorageInfo:
    info = meta.storage.get((tensor.fqn, offsets))
    if info is None:
        raise CheckpointFormatError(
            f"{meta.url}: '{tensor.fqn}' has a chunk at offsets {list(offsets)} but "
            "'storage_data' does not say where it is stored; the metadata is corrupt"
        )
    if info.transform_descriptors:
        raise UnsupportedCheckpointError(
            f"{meta.url}: '{tensor.fqn}' was saved through the stream transform(s) "
            f"{list(info.transform_descriptors)} (e.g. compression), which zerosafe does not "
            "read. Save without `_extensions`, or load and re-save the checkpoint with plain "
            "torch.distributed.checkpoint.save."
        )
    return info


def _file_rank(name: str, fallback: int) -> int:
    found = _DISTCP_NAME.search(name)
    return int(found.group(1)) if found else fallback


def _open_files(
    url: str, names: Sequence[str], storage: Storage
) -> tuple[dict[str, ByteSource], dict[str, FileIdentity]]:
    sources: dict[str, ByteSource] = {}
    identities: dict[str, FileIdentity] = {}
    for name in names:
        file_url = join_url(url, name)
        try:
            sources[name] = storage.open_source(file_url)
        except CheckpointFormatError as e:
            raise CheckpointFormatError(
                f"{file_url}: this .distcp file is named in '{METADATA_FILE}' but missing; the "
                "checkpoint was copied in part or a rank's save did not finish. Copy the whole "
                "folder again."
            ) from e
        identities[name] = storage.identity(file_url)
    return sources, identities


def _plan_chunks(
    meta: DcpMetadata, chosen: Sequence[tuple[str, str]]
) -> list[tuple[TensorMeta, str, list[tuple[ChunkBox, ChunkRuns, StorageInfo | None]]]]:
    """Per selected tensor, its chunks with their runs and (non-empty ones) storage."""
    planned = []
    for fqn, name in chosen:
        tensor = meta.tensors[fqn]
        boxes = [ChunkBox(offsets=o, sizes=s) for o, s in tensor.chunks]
        runs = check_chunk_cover(tensor.size, boxes, where=f"{meta.url}: '{fqn}'")
        chunks = [
            (box, r, _storage_of(meta, tensor, box.offsets) if box.numel else None)
            for box, r in zip(boxes, runs, strict=True)
        ]
        planned.append((tensor, name, chunks))
    return planned


def _read_metadata(url: str, storage: Storage) -> DcpMetadata:
    meta_url = join_url(url, METADATA_FILE)
    try:
        data = storage.read_bytes(meta_url)
    except (FileNotFoundError, CheckpointFormatError) as e:
        distcp = [n for n in storage.listdir(url) if n.endswith(".distcp")]
        hint = (
            f"the folder has {len(distcp)} .distcp file(s) but no '{METADATA_FILE}': DCP writes "
            "it last, so the save did not finish (or it was not copied)"
            if distcp
            else "the folder is not a PyTorch DCP checkpoint"
        )
        raise CheckpointFormatError(f"{meta_url}: not found; {hint}.") from e
    return parse_metadata(data, meta_url)


def _locate_all(
    url: str,
    planned: Sequence[tuple[TensorMeta, str, list[tuple[ChunkBox, ChunkRuns, StorageInfo | None]]]],
    sources: dict[str, ByteSource],
    max_workers: int,
) -> list[list[StoredChunk | None]]:
    headers: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in sources}

    def one(tensor: TensorMeta, box: ChunkBox, info: StorageInfo | None) -> StoredChunk | None:
        if info is None:
            return None
        if info.relative_path not in sources:
            raise CheckpointFormatError(
                f"{url}: '{tensor.fqn}' is stored in '{info.relative_path}', outside the folder"
            )
        return locate_chunk(
            sources[info.relative_path], fqn=tensor.fqn, offset=info.offset,
            length=info.length, dtype=tensor.dtype, chunk_offsets=box.offsets,
            chunk_sizes=box.sizes, header_cache=headers[info.relative_path],
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        futures = [
            [pool.submit(one, tensor, box, info) for box, _, info in chunks]
            for tensor, _, chunks in planned
        ]
        return [[f.result() for f in row] for row in futures]


def read_dcp_layout(
    url: str,
    storage: Storage,
    selection: DcpSelection | None = None,
    *,
    max_workers: int = 8,
) -> DcpLayout:
    """Read a DCP checkpoint's metadata and chunk headers into a layout.

    Args:
        url: The checkpoint folder (local, NFS or an fsspec URL such as `s3://...`).
        storage: Opens its files.
        selection: Which tensors to convert; the default of `DcpSelection`.
        max_workers: Chunk headers read at once (each is a few small ranged reads).

    Returns:
        The files, slots and tensors of the selected part of the checkpoint.

    Raises:
        CheckpointFormatError: If `.metadata` or a `.distcp` file is missing, truncated or
            disagrees with the metadata, or chunks overlap or leave gaps.
        UnsafePickleError: If `.metadata` names a global outside the DCP allowlist.
        UnsupportedCheckpointError: If a chunk was saved through a stream transform.
        ConfigError: If the selection matches no tensor.
    """
    selection = selection or DcpSelection()
    meta = _read_metadata(url, storage)
    chosen = select_tensors(list(meta.tensors), selection, where=url)
    planned = _plan_chunks(meta, chosen)
    names = sorted({info.relative_path for _, _, ch in planned for _, _, info in ch if info})
    sources, identities = _open_files(url, names, storage)
    try:
        located = _locate_all(url, planned, sources, max_workers)
    finally:
        for source in sources.values():
            source.close()
    files = tuple(
        SourceFile(
            index=i, url=identities[n].url, role="distcp", rank=_file_rank(n, i),
            size_bytes=identities[n].size_bytes, version=identities[n].version,
        )
        for i, n in enumerate(names)
    )  # fmt: skip
    file_index = {n: i for i, n in enumerate(names)}
    slots: list[Slot] = []
    tensors: list[LayoutTensor] = []
    for (tensor, name, chunks), stored in zip(planned, located, strict=True):
        pieces = []
        for (box, runs, info), chunk in zip(chunks, stored, strict=True):
            if chunk is None or info is None:
                continue
            file = file_index[info.relative_path]
            pieces.append(TensorPiece(slot=len(slots), runs=runs))
            slots.append(_slot(len(slots), files[file], tensor.fqn, box, chunk))
        tensors.append(
            LayoutTensor(
                name=name, fqn=tensor.fqn, shape=tensor.size, dtype=tensor.dtype,
                role="param", pieces=tuple(pieces),
            )
        )  # fmt: skip
    meta_identity = storage.identity(join_url(url, METADATA_FILE))
    identity = (meta_identity.as_dict(), *(identities[n].as_dict() for n in names))
    return DcpLayout(
        url=url,
        files=files,
        slots=tuple(slots),
        tensors=tuple(tensors),
        non_tensor_entries=meta.byte_entries,
        notes=tuple(_notes(meta, chosen, located)),
        source=_source(url, meta, chosen, files, identity),
        identity=identity,
    )


def _slot(index: int, file: SourceFile, fqn: str, box: ChunkBox, chunk: StoredChunk) -> Slot:
    return Slot(
        index=index, file=file.index, rank=file.rank, kind="chunk",
        name=f"{fqn}@{','.join(map(str, box.offsets))}", record=chunk.record,
        record_offset=chunk.record_offset, record_size_bytes=chunk.record_size_bytes,
        record_crc32=chunk.record_crc32, element_offset=chunk.element_offset,
        numel=chunk.numel, dtype=chunk.dtype,
    )  # fmt: skip


def _notes(
    meta: DcpMetadata,
    chosen: Sequence[tuple[str, str]],
    located: Sequence[Sequence[StoredChunk | None]],
) -> list[str]:
    notes = []
    picked = {fqn for fqn, _ in chosen}
    left = [k for k in meta.tensors if k not in picked]
    if left:
        tops = sorted({k.split(".", 1)[0] for k in left})
        notes.append(
            f"{len(left)} tensor(s) not selected and not read (top-level keys {tops}); "
            "--select PREFIX converts them"
        )
    if meta.byte_entries:
        shown = ", ".join(meta.byte_entries[:8]) + (" ..." if len(meta.byte_entries) > 8 else "")
        notes.append(
            f"{len(meta.byte_entries)} non-tensor entr(ies) listed in the manifest, not "
            f"converted: {shown}"
        )
    formats = {c.serialization for row in located for c in row if c is not None}
    if "safetensors" in formats:
        notes.append("chunks stored as safetensors (SerializationFormat.SAFETENSORS)")
    return notes


def _source(
    url: str,
    meta: DcpMetadata,
    chosen: Sequence[tuple[str, str]],
    files: Sequence[SourceFile],
    identity: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "format": "dcp",
        "format_name": FORMAT_NAME,
        "checkpoint": url,
        "dcp_version": meta.version,
        "num_tensors_in_checkpoint": len(meta.tensors),
        "num_tensors_selected": len(chosen),
        "num_params": sum(_numel(meta.tensors[fqn].size) for fqn, _ in chosen),
        "non_tensor_entries": list(meta.byte_entries),
        "num_distcp_files": len({info.relative_path for info in meta.storage.values()}),
        "checkpoint_bytes": sum(int(i["size_bytes"]) for i in identity),
        "files": list(identity),
    }


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
