"""PyTorch Distributed Checkpoint (DCP) folders as a format reader: a `SourceLayout`.

A DCP folder (torch.distributed.checkpoint, as FSDP2, torchtitan, accelerate, Lightning and
Megatron's `torch_dist` write it) holds `.metadata` and `__{rank}_{n}.distcp` files; see
`metadata.py` for the metadata, `stored.py` for how each chunk is stored and `chunks.py` for
where its elements go. This module selects the tensors to convert, finds every chunk's stored
bytes (one slot per chunk) and cuts each chunk into fragments: runs of contiguous output
elements. Only the metadata and the chunks' own headers are read; tensor bytes never are, and
the chunks of tensors that are not selected (optimizer state, by default) are not touched.
What `inspect` and the manifest say about a DCP checkpoint is in `facts.py`.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError, ConfigError, UnsupportedCheckpointError
from zerosafe.formats.base import (
    Fragment,
    Slot,
    SourceFile,
    SourceLayout,
    SourceTensor,
    one_save_tag,
)
from zerosafe.formats.dcp.chunks import ChunkBox, ChunkRuns, check_chunk_cover
from zerosafe.formats.dcp.facts import dcp_facts, dcp_notes, dcp_source_block
from zerosafe.formats.dcp.metadata import DcpMetadata, StorageInfo, TensorMeta, parse_metadata
from zerosafe.formats.dcp.stored import StoredChunk, locate_chunk
from zerosafe.formats.optimizer_state import is_optimizer_state
from zerosafe.io.storage import ByteSource, FileIdentity, Storage, join_url, normalize_url

__all__ = [
    "FORMAT_NAME",
    "METADATA_FILE",
    "DcpReader",
    "DcpSelection",
    "Selected",
    "is_dcp_checkpoint",
    "read_dcp_layout",
    "read_metadata",
    "select_tensors",
]

log = logging.getLogger(__name__)

FORMAT_NAME = "PyTorch DCP"
METADATA_FILE = ".metadata"
_METADATA_MAX_BYTES = 4 * 2**30
"""`.metadata` is read whole, so it is capped: it holds one entry per chunk (about 144 bytes
pickled, measured with torch 2.13), and a chunk per tensor per rank under FSDP. A 405B model
(about 1,140 tensors) with Adam's two moments saved from 2,048 ranks comes to about 7 million
chunks, 1 GiB; 4 GiB leaves room beyond that, and refuses a wrong file (a link to a device, a
weight file renamed) before it fills memory."""
_DISTCP_NAME = re.compile(r"__(\d+)_(\d+)\.distcp$")

_Planned = list[tuple[TensorMeta, str, list[tuple[ChunkBox, ChunkRuns, StorageInfo | None]]]]


class DcpReader:
    """PyTorch DCP checkpoints: a folder holding `.metadata` and `*.distcp` files."""

    name = "dcp"
    title = FORMAT_NAME
    looks_like = "a folder holding `.metadata` and `__R_S.distcp` files"
    selects = True
    parts_below: tuple[str, ...] = ("dcp",)
    tag_folders = False

    def detect(self, storage: Storage, url: str) -> bool:
        url = normalize_url(url)
        return storage.isdir(url) and METADATA_FILE in storage.listdir(url)

    def quick_identities(
        self, storage: Storage, url: str, tag: str | None
    ) -> tuple[str, list[FileIdentity]]:
        url = normalize_url(url)
        resolved = _tag_of(url, tag)
        names = [METADATA_FILE, *_distcp_names(storage, url)]
        return resolved, [storage.identity(join_url(url, n)) for n in names]

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        url = normalize_url(url)
        _tag_of(url, tag)
        selection = DcpSelection(select=options.select, strip_prefix=options.strip_prefix)
        return read_dcp_layout(url, storage, selection)


def _tag_of(url: str, tag: str | None) -> str:
    """A DCP folder is one save: its tag is the folder's name (`step-1000`)."""
    parent = url.rstrip("/").rsplit("/", 1)[0]
    return one_save_tag(
        url, tag, this="a PyTorch DCP checkpoint",
        give=f"the folder holding the save's .metadata (e.g. {parent}/{tag})",
    )  # fmt: skip


def _distcp_names(storage: Storage, url: str) -> list[str]:
    return sorted(n for n in storage.listdir(url) if n.endswith(".distcp"))


@dataclass(frozen=True, kw_only=True, slots=True)
class DcpSelection:
    """Which tensors of a DCP checkpoint to convert, and how to name them.

    With neither field set: the tensors under the top-level `model` key, `model.` stripped
    (the layout of torchtitan, Lightning and `get_state_dict`). Without one, where the save
    holds optimizer state beside the weights: the one subtree named `model` (`app.model` in
    PyTorch's `{"app": AppState(model, optim)}` recipe), its prefix stripped; several, or
    none, are refused (`_default_selection`). A save of weights only: every tensor.
    """

    select: tuple[str, ...] = ()
    """Key prefixes to convert (`model`, `model.layers.0`); a prefix matches whole dotted
    components. Empty: the default above."""
    strip_prefix: str | None = None
    """A prefix removed from the output names (`model`); None: the default's, or none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Selected:
    """What a selection chose: `(fqn, output name)` pairs and the rules that applied."""

    pairs: list[tuple[str, str]]
    select: tuple[str, ...]
    strip_prefix: str | None
    model_subtree: str | None = None
    """The subtree the default selection took for the model's where the save has no
    top-level `model` key (`app.model`); None otherwise."""


def is_dcp_checkpoint(url: str, storage: Storage) -> bool:
    """Whether `url` is a DCP checkpoint folder (it has a `.metadata` file)."""
    return DcpReader().detect(storage, url)


def _matches(fqn: str, prefix: str) -> bool:
    prefix = prefix.rstrip(".")
    return prefix == "" or fqn == prefix or fqn.startswith(prefix + ".")


def select_tensors(keys: Sequence[str], selection: DcpSelection, *, where: str = "") -> Selected:
    """The keys to convert, in the order given, with their output names.

    Raises:
        ConfigError: If the selection matches nothing, takes optimizer state together with
            weights, or two keys get the same output name.
        CheckpointFormatError: If, by default, the model's tensors cannot be told from the
            rest (`_default_selection`).
    """
    select = selection.select
    strip = selection.strip_prefix
    subtree = None
    if not select:
        select, default_strip, subtree = _default_selection(keys, where)
        if strip is None:
            strip = default_strip
    chosen = [k for k in keys if any(_matches(k, p) for p in select)]
    if not chosen:
        tops = sorted({k.split(".", 1)[0] for k in keys})
        raise ConfigError(
            f"{where}: no tensor matches `select` {list(select)}; the checkpoint's top-level "
            f"keys are {tops[:20]}. Pass --select with one of them."
        )
    optim = next((k for k in chosen if is_optimizer_state(k)), None)
    weight = next((k for k in chosen if not is_optimizer_state(k)), None)
    if optim is not None and weight is not None:
        # all weights, or all optimizer state (`--select optim.state`), never the two mixed
        raise ConfigError(
            f"{where}: `select` {list(select)} takes optimizer state ('{optim}') together with "
            f"weights ('{weight}'), which would write the moments as if they were trained "
            "tensors; select the model's subtree alone (or the optimizer state alone)"
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
    return Selected(pairs=out, select=tuple(select), strip_prefix=strip, model_subtree=subtree)


def _default_selection(
    keys: Sequence[str], where: str
) -> tuple[tuple[str, ...], str | None, str | None]:
    """`(select, strip_prefix, model_subtree)` when the user chose none.

    The top-level `model` key if there is one. Otherwise, a save of weights only (a plain
    `dcp.save(model.state_dict())`, or optimizer state only, which `refuse_optimizer_only`
    refuses) is converted whole; where optimizer state sits beside the weights, the one
    subtree named `model` is the model (`app.model`), and anything else is refused: never
    write the moments as weights.

    Raises:
        CheckpointFormatError: Optimizer state beside several subtrees named `model`, or
            beside weights in none; each choice is listed with the options that pick it.
    """
    if any(_matches(k, "model") and k != "model" for k in keys):
        return ("model",), "model", None
    optim = [k for k in keys if is_optimizer_state(k)]
    weights = [k for k in keys if not is_optimizer_state(k)]
    if not optim or not weights:
        return ("",), None, None
    candidates = sorted({c for k in weights if (c := _model_subtree(k))})
    if len(candidates) == 1:
        return (candidates[0],), candidates[0], candidates[0]
    if candidates:
        found = f"{len(candidates)} subtrees named `model`"
        choices = candidates
    else:
        found = "no subtree named `model`"
        choices = list(dict.fromkeys(_weight_subtree(k, optim) for k in weights))
    shown = ", ".join(_choice(c, weights) for c in choices[:6])
    raise CheckpointFormatError(
        f"{where}: no top-level `model` key, {found}, and optimizer state beside the weights "
        f"({len(optim)} tensors, e.g. '{optim[0]}'), which is never converted as weights; "
        f"pick the model's tensors: {shown}{' ...' if len(choices) > 6 else ''}"
    )


def _model_subtree(key: str) -> str | None:
    """`app.model` for `app.model.layers.0.weight`: the key's path up to its first component
    named `model` (not the last, which is a tensor's own name)."""
    parts = key.split(".")
    if "model" not in parts[:-1]:
        return None
    return ".".join(parts[: parts.index("model") + 1])


def _weight_subtree(key: str, optim: Sequence[str]) -> str:
    """The shortest path above `key` that holds no optimizer state (`net` for `net.w`
    beside `opt.state.w.exp_avg`; `app.net` beside `app.optim...`)."""
    parts = key.split(".")
    for n in range(1, len(parts)):
        prefix = ".".join(parts[:n])
        if not any(_matches(k, prefix) for k in optim):
            return prefix
    return key


def _choice(prefix: str, weights: Sequence[str]) -> str:
    if prefix in weights:  # a tensor of its own at that level: nothing to strip
        return f"'{prefix}' (`--select {prefix}`)"
    return f"'{prefix}' (`--select {prefix} --strip-prefix {prefix}.`)"


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
    try:
        for name in names:
            file_url = join_url(url, name)
            try:
                sources[name] = storage.open_source(file_url)
            except (CheckpointFormatError, FileNotFoundError) as e:
                raise CheckpointFormatError(
                    f"{file_url}: this .distcp file is named in '{METADATA_FILE}' but missing; "
                    "the checkpoint was copied in part or a rank's save did not finish. Copy "
                    "the whole folder again."
                ) from e
            identities[name] = storage.identity(file_url)
    except BaseException:
        for source in sources.values():
            source.close()
        raise
    return sources, identities


def _plan_chunks(meta: DcpMetadata, chosen: Sequence[tuple[str, str]]) -> _Planned:
    """Per selected tensor, its chunks with their runs and (non-empty ones) storage."""
    planned: _Planned = []
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


def read_metadata(url: str, storage: Storage) -> tuple[DcpMetadata, str]:
    """The parsed `.metadata` of the DCP folder `url` and the SHA-256 of its bytes.

    Raises:
        CheckpointFormatError: If it is missing (saying whether the save did not finish),
            not DCP metadata, or too large.
        UnsafePickleError: If it names a global outside the DCP allowlist.
    """
    meta_url = join_url(url, METADATA_FILE)
    try:
        data = storage.read_small(
            meta_url,
            limit_bytes=_METADATA_MAX_BYTES,
            what="PyTorch DCP's metadata (a pickle of the chunk index)",
        )
    except (FileNotFoundError, CheckpointFormatError) as e:
        if not isinstance(e, FileNotFoundError) and storage.exists(meta_url):
            raise  # there, but refused: a FIFO, a device, or too large
        distcp = [n for n in storage.listdir(url) if n.endswith(".distcp")]
        hint = (
            f"the folder has {len(distcp)} .distcp file(s) but no '{METADATA_FILE}': DCP writes "
            "it last, so the save did not finish (or it was not copied)"
            if distcp
            else "the folder is not a PyTorch DCP checkpoint"
        )
        raise CheckpointFormatError(f"{meta_url}: not found; {hint}.") from e
    return parse_metadata(data, meta_url), hashlib.sha256(data).hexdigest()


def _locate_all(
    url: str, planned: _Planned, sources: dict[str, ByteSource], max_workers: int
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
            raw_tensor=info.raw_tensor,
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        futures = [
            [pool.submit(one, tensor, box, info) for box, _, info in chunks]
            for tensor, _, chunks in planned
        ]
        return [[f.result() for f in row] for row in futures]


def _source_files(
    url: str, storage: Storage, needed: dict[str, FileIdentity]
) -> tuple[list[SourceFile], dict[str, int]]:
    """`.metadata` and every `.distcp` file of the folder (the job's identity, in
    `quick_identities` order), and the index of each `.distcp` file."""
    names = [METADATA_FILE, *_distcp_names(storage, url)]
    files: list[SourceFile] = []
    for i, name in enumerate(names):
        ident = needed.get(name) or storage.identity(join_url(url, name))
        files.append(
            SourceFile(
                index=i, url=ident.url, role="metadata" if i == 0 else "distcp",
                rank=0 if i == 0 else _file_rank(name, i - 1),
                size_bytes=ident.size_bytes, version=ident.version,
            )
        )  # fmt: skip
    return files, {n: i for i, n in enumerate(names)}


def read_dcp_layout(
    url: str,
    storage: Storage,
    selection: DcpSelection | None = None,
    *,
    max_workers: int = 8,
    metadata: tuple[DcpMetadata, str] | None = None,
) -> SourceLayout:
    """Read a DCP checkpoint's metadata and chunk headers into a `SourceLayout`.

    Args:
        url: The checkpoint folder (local, NFS or an fsspec URL such as `s3://...`).
        storage: Opens its files.
        selection: Which tensors to convert; the default of `DcpSelection`.
        max_workers: Chunk headers read at once (each is a few small ranged reads).
        metadata: `.metadata` as `read_metadata` returned it, where the caller has read it
            (a format built on DCP: Megatron's `torch_dist`); else it is read here.

    Raises:
        CheckpointFormatError: If `.metadata` or a `.distcp` file is missing, truncated or
            disagrees with the metadata, or chunks overlap or leave gaps, or the default
            selection cannot tell the model's tensors from optimizer state.
        UnsafePickleError: If `.metadata` names a global outside the DCP allowlist.
        UnsupportedCheckpointError: If a chunk was saved through a stream transform.
        ConfigError: If the selection matches no tensor.
    """
    url = normalize_url(url)
    read_before = storage.counter.bytes_read
    meta, meta_sha = metadata or read_metadata(url, storage)
    selected = select_tensors(list(meta.tensors), selection or DcpSelection(), where=url)
    planned = _plan_chunks(meta, selected.pairs)
    names = sorted({info.relative_path for _, _, ch in planned for _, _, info in ch if info})
    sources, identities = _open_files(url, names, storage)
    try:
        located = _locate_all(url, planned, sources, max_workers)
    finally:
        for source in sources.values():
            source.close()
    files, file_index = _source_files(url, storage, identities)
    slots: list[Slot] = []
    tensors: dict[str, SourceTensor] = {}
    for (tensor, name, chunks), stored in zip(planned, located, strict=True):
        fragments: list[Fragment] = []
        for (box, runs, info), chunk in zip(chunks, stored, strict=True):
            if chunk is None or info is None:
                continue
            slot = len(slots)
            slots.append(_slot(slot, files[file_index[info.relative_path]], tensor.fqn, box, chunk))
            fragments += [(slot, src, n, dst) for src, n, dst in runs]
        fragments.sort(key=lambda f: f[3])
        tensors[name] = SourceTensor(
            name=name, shape=tensor.size, dtype=tensor.dtype, role="param",
            fragments=tuple(fragments),
        )  # fmt: skip
    return SourceLayout(
        format=DcpReader.name, where=url, tag=_tag_of(url, None), files=files, slots=slots,
        tensors=tensors, order=list(tensors),
        source=dcp_source_block(url, meta, selected, files, _fingerprint(meta_sha, slots)),
        facts=dcp_facts(url, meta, selected, files, slots, located),
        metadata_bytes=storage.counter.bytes_read - read_before,
        notes=dcp_notes(meta, selected, located), main_slot_kind="chunk",
    )  # fmt: skip


def _slot(index: int, file: SourceFile, fqn: str, box: ChunkBox, chunk: StoredChunk) -> Slot:
    return Slot(
        index=index, file=file.index, rank=file.rank, kind="chunk",
        name=f"{fqn}@{','.join(map(str, box.offsets))}", record=chunk.record,
        record_offset=chunk.record_offset, record_size_bytes=chunk.record_size_bytes,
        record_crc32=chunk.record_crc32, element_offset=chunk.element_offset,
        numel=chunk.numel, dtype=chunk.dtype,
    )  # fmt: skip


def _fingerprint(meta_sha: str, slots: Sequence[Slot]) -> str:
    """SHA-256 over the `.metadata` bytes (each save has its own `save_id`) and every
    selected chunk's name, size and CRC-32 (torch.save form): from headers only, the same
    after copies and moves, and different for another save or a changed chunk."""
    h = hashlib.sha256(meta_sha.encode() + b"\n")
    for s in sorted(slots, key=lambda s: s.name):
        h.update(f"{s.name}\0{s.record_size_bytes}\0{s.record_crc32}\n".encode())
    return h.hexdigest()
