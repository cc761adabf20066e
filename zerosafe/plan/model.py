"""The conversion plan: every output tensor as a list of byte-range fragments of source slots.

A *slot* is one contiguous run of elements in one source file (a rank's fp32 partition, a
frozen fragment, a buffer). A *fragment* copies `numel` elements from a slot, starting at
`src_offset`, to `dst_offset` in an output tensor. Fragments of a tensor tile it exactly, in
order, so merging is a sequence of range copies. Output tensors are assigned to *shards*
(output files) greedily by `max_shard_bytes`; in staged mode, slots are copied to
intermediate files in *extract parts*.

The plan is a pure function of the checkpoint's metadata and the options, is stored as Parquet
tables plus `plan.json` in the work area, and every later stage is a function of (plan, index).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from zerosafe._version import __version__
from zerosafe.config import ConvertOptions
from zerosafe.dtypes import dtype_info
from zerosafe.errors import CheckpointFormatError, LayoutMismatchError
from zerosafe.formats.deepspeed.checkpoint import LoadedFile, ZeroCheckpoint
from zerosafe.formats.deepspeed.layout import (
    split_by_segments,
    zero3_pieces,
    zero12_partition_pieces,
)
from zerosafe.formats.deepspeed.save_identity import check_module_copy_sample
from zerosafe.formats.torch_zip import TensorRecord
from zerosafe.io.storage import Storage, join_url
from zerosafe.verify.source import content_fingerprint

__all__ = [
    "PLAN_FORMAT",
    "ExtractPart",
    "FragmentTable",
    "Plan",
    "ShardSpec",
    "Slot",
    "SourceFile",
    "TensorSpec",
    "build_plan",
    "load_plan",
    "save_plan",
    "shard_file_name",
]

log = logging.getLogger(__name__)

PLAN_FORMAT = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceFile:
    index: int
    url: str
    role: str
    rank: int
    size_bytes: int
    version: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Slot:
    """A contiguous run of elements in a source file that fragments read from."""

    index: int
    file: int
    rank: int
    kind: str
    """`fp32` (master partition), `frozen` (16-bit frozen param) or `buffer`."""
    name: str
    record: str
    record_offset: int
    """Absolute file offset of the zip record's data."""
    record_size_bytes: int
    record_crc32: int
    element_offset: int
    """Offset of the slot's first element inside the record."""
    numel: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return dtype_info(self.dtype).itemsize

    @property
    def byte_offset(self) -> int:
        """Absolute file offset of the slot's first byte."""
        return self.record_offset + self.element_offset * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    index: int
    name: str
    shape: tuple[int, ...]
    role: str
    """`param`, `frozen`, `buffer`, or `tied` (an alias written as a copy)."""
    src_dtype: str
    out_dtype: str
    shard: int
    alias_of: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def out_nbytes(self) -> int:
        return self.numel * dtype_info(self.out_dtype).itemsize


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardSpec:
    index: int
    file_name: str
    first_tensor: int
    num_tensors: int
    data_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ExtractPart:
    """One staged-mode extract task: element ranges of one rank's slots, into one file."""

    index: int
    rank: int
    file_name: str
    pieces: tuple[tuple[int, int, int], ...]
    """`(slot, element_start, numel)` in file order."""

    @property
    def number(self) -> int:
        """This part's number among its rank's parts."""
        return int(self.file_name.removesuffix(".safetensors").rsplit("-part", 1)[1])


@dataclass
class FragmentTable:
    """Fragments as int64 columns, sorted by (tensor, dst_offset)."""

    tensor: np.ndarray
    slot: np.ndarray
    src_offset: np.ndarray
    numel: np.ndarray
    dst_offset: np.ndarray

    COLUMNS = ("tensor", "slot", "src_offset", "numel", "dst_offset")

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[int, int, int, int, int]]) -> FragmentTable:
        arr = np.array(rows, dtype=np.int64).reshape(-1, 5)
        order = np.lexsort((arr[:, 4], arr[:, 0]))
        arr = arr[order]
        return cls(*(np.ascontiguousarray(arr[:, i]) for i in range(5)))

    def __len__(self) -> int:
        return len(self.tensor)

    def for_tensor(self, index: int) -> list[tuple[int, int, int, int]]:
        """`(slot, src_offset, numel, dst_offset)` of one tensor, in destination order."""
        lo = int(np.searchsorted(self.tensor, index, side="left"))
        hi = int(np.searchsorted(self.tensor, index, side="right"))
        return [
            (
                int(self.slot[i]),
                int(self.src_offset[i]),
                int(self.numel[i]),
                int(self.dst_offset[i]),
            )
            for i in range(lo, hi)
        ]


@dataclass(kw_only=True)
class Plan:
    """Everything every stage needs; see the module docstring."""

    plan_id: str
    """Hash of the source identity, the byte-affecting options and zerosafe's plan format."""
    source: dict[str, Any]
    options: dict[str, Any]
    files: list[SourceFile]
    slots: list[Slot]
    tensors: list[TensorSpec]
    shards: list[ShardSpec]
    parts: list[ExtractPart]
    fragments: FragmentTable
    aliases: dict[str, str]
    """Tied aliases left out of the output (dedupe mode): alias -> stored target."""
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    created_by: str = f"zerosafe {__version__}"

    @property
    def total_out_bytes(self) -> int:
        return sum(t.out_nbytes for t in self.tensors)

    @property
    def fp32_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots if s.kind == "fp32")

    @property
    def slot_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def shard_tensors(self, shard: int) -> list[TensorSpec]:
        spec = self.shards[shard]
        return self.tensors[spec.first_tensor : spec.first_tensor + spec.num_tensors]

    def shard_source_bytes(self, shard: int) -> int:
        """Source bytes a merge of this shard reads."""
        total = 0
        for t in self.shard_tensors(shard):
            for slot, _, numel, _ in self.fragments.for_tensor(t.index):
                total += numel * self.slots[slot].itemsize
        return total

    def part_bytes(self, part: int) -> int:
        return sum(n * self.slots[s].itemsize for s, _, n in self.parts[part].pieces)

    def shard_parts(self) -> list[list[int]]:
        """Per output shard, the extract parts (staged mode) its merge reads, in order."""
        parts_of_slot: dict[int, set[int]] = {}
        for p in self.parts:
            for slot, _, _ in p.pieces:
                parts_of_slot.setdefault(slot, set()).add(p.index)
        out = []
        for shard in self.shards:
            slots = {
                slot
                for t in self.shard_tensors(shard.index)
                for slot, *_ in self.fragments.for_tensor(t.index)
            }
            out.append(sorted({p for slot in slots for p in parts_of_slot.get(slot, ())}))
        return out


def shard_file_name(index: int, count: int) -> str:
    """Hugging Face shard naming: `model.safetensors` or `model-00001-of-00004.safetensors`."""
    if count == 1:
        return "model.safetensors"
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _source_identity(ckpt: ZeroCheckpoint) -> list[dict[str, Any]]:
    return [f.identity.as_dict() for f in ckpt.files]


def job_key_of(tag: str, identities: list[dict[str, Any]], options: ConvertOptions) -> str:
    """Identity of a conversion: which files (URL, size, version) and which output options."""
    blob = json.dumps(
        {
            "plan_format": PLAN_FORMAT,
            "tag": tag,
            "files": identities,
            "options": options.identity(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def job_key(ckpt: ZeroCheckpoint, options: ConvertOptions) -> str:
    """`job_key_of` for a checkpoint whose metadata was read."""
    return job_key_of(ckpt.tag, _source_identity(ckpt), options)


class _SlotBuilder:
    def __init__(self, ckpt: ZeroCheckpoint) -> None:
        self.files: list[SourceFile] = []
        self._file_index: dict[str, int] = {}
        self._loaded: dict[str, LoadedFile] = {}
        self.slots: list[Slot] = []
        self._pending: list[tuple[LoadedFile, int, str, str, TensorRecord]] = []
        for f in ckpt.files:
            self._file_index[f.url] = len(self.files)
            self._loaded[f.url] = f
            self.files.append(
                SourceFile(
                    index=len(self.files), url=f.url, role=f.role, rank=f.rank,
                    size_bytes=f.identity.size_bytes, version=f.identity.version,
                )
            )  # fmt: skip

    def add(self, loaded: LoadedFile, kind: str, name: str, tensor: TensorRecord) -> int:
        index = len(self._pending)
        self._pending.append((loaded, loaded.rank, kind, name, tensor))
        return index

    def resolve(self, max_workers: int = 8) -> list[Slot]:
        """Read the zip local headers of every slot's record (one small read each)."""

        def one(item: tuple[LoadedFile, int, str, str, TensorRecord]) -> Slot:
            loaded, rank, kind, name, t = item
            record = loaded.zip.storage_record(t.storage.key)
            offset = loaded.zip.data_offset(record)
            end = (t.storage_offset + t.numel) * t.itemsize
            if end > record.size_bytes:
                raise CheckpointFormatError(
                    f"{loaded.url}: tensor '{name}' needs {end} bytes of record "
                    f"'{record.name}', which holds {record.size_bytes}; the file is corrupt"
                )
            return Slot(
                index=0, file=self._file_index[loaded.url], rank=rank, kind=kind, name=name,
                record=record.name, record_offset=offset, record_size_bytes=record.size_bytes,
                record_crc32=record.crc32, element_offset=t.storage_offset, numel=t.numel, dtype=t.dtype,
            )  # fmt: skip

        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            resolved = list(pool.map(one, self._pending))
        self.slots = [
            Slot(**{**{f.name: getattr(s, f.name) for f in fields(Slot)}, "index": i})
            for i, s in enumerate(resolved)
        ]
        return self.slots


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def build_plan(ckpt: ZeroCheckpoint, options: ConvertOptions) -> Plan:
    """Plan the conversion of `ckpt` under `options`. Reads only zip local headers.

    Raises:
        LayoutMismatchError: If the partitions do not hold exactly the params they should.
    """
    builder = _SlotBuilder(ckpt)
    rows: list[tuple[int, int, int, int, int]] = []  # (param name id, slot, src, numel, dst)
    param_fragments: dict[str, list[tuple[int, int, int, int]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    src_dtypes: dict[str, str] = {}
    roles: dict[str, str] = {}
    world_size = ckpt.world_size

    def add_fragment(name: str, slot: int, src: int, numel: int, dst: int) -> None:
        param_fragments.setdefault(name, []).append((slot, src, numel, dst))

    fp32_slot: dict[tuple[int, int], int] = {}
    for f in ckpt.optim_files:
        for g, t in enumerate(ckpt.fp32_partitions[f.rank]):
            fp32_slot[(f.rank, g)] = builder.add(f, "fp32", f"fp32/group{g}", t)

    if ckpt.stage in (1, 2):
        for g, group in enumerate(ckpt.param_groups):
            numels = [_numel(shape) for _, shape in group]
            saved = [ckpt.fp32_partitions[r][g].numel for r in range(world_size)]
            pieces = zero12_partition_pieces(
                numels, ckpt.alignment_paddings[g], ckpt.partition_numels[g], saved,
                where=f"{ckpt.tag_url}: param group {g}",
            )  # fmt: skip
            for piece in pieces:
                name = group[piece.param][0]
                add_fragment(
                    name,
                    fp32_slot[(piece.rank, g)],
                    piece.src_offset,
                    piece.numel,
                    piece.dst_offset,
                )
    else:
        flat = [(name, shape) for group in ckpt.param_groups for name, shape in group]
        pieces, per_rank = zero3_pieces([_numel(s) for _, s in flat], world_size)
        num_groups = len(ckpt.fp32_partitions[0])
        for rank in range(world_size):
            saved_numel = sum(t.numel for t in ckpt.fp32_partitions[rank])
            if saved_numel != per_rank:
                raise LayoutMismatchError(
                    f"{ckpt.optim_files[rank].url}: rank {rank} saved {saved_numel} fp32 elements but "
                    f"'param_shapes' partitioned over {world_size} ranks needs exactly {per_rank}; "
                    "was the checkpoint saved with another world size or another model?"
                )
        for piece in pieces:
            segments = [t.numel for t in ckpt.fp32_partitions[piece.rank]]
            name = flat[piece.param][0]
            for seg, seg_offset, count, run_offset in split_by_segments(
                piece.src_offset, piece.numel, segments
            ):
                assert seg < num_groups
                add_fragment(
                    name,
                    fp32_slot[(piece.rank, seg)],
                    seg_offset,
                    count,
                    piece.dst_offset + run_offset,
                )

    for group in ckpt.param_groups:
        for name, shape in group:
            shapes[name] = shape
            src_dtypes[name] = "float32"
            roles[name] = "param"

    if not options.exclude_frozen:
        for fp in ckpt.frozen:
            shapes[fp.name] = fp.shape
            src_dtypes[fp.name] = fp.dtype
            roles[fp.name] = "frozen"
            numel = _numel(fp.shape)
            dst = 0
            for rank, t in fp.pieces:
                loaded = next(f for f in ckpt.model_files if f.rank == rank)
                slot = builder.add(loaded, "frozen", f"frozen/{fp.name}", t)
                count = min(t.numel, numel - dst)
                if count > 0:
                    add_fragment(fp.name, slot, 0, count, dst)
                dst += count
    for name, t in ckpt.buffers:
        shapes[name] = t.shape
        src_dtypes[name] = t.dtype
        roles[name] = "buffer"
        if t.numel:
            if not t.is_contiguous():
                raise CheckpointFormatError(
                    f"{ckpt.model_files[0].url}: buffer '{name}' is not contiguous"
                )
            slot = builder.add(ckpt.model_files[0], "buffer", f"buffer/{name}", t)
            add_fragment(name, slot, 0, t.numel, 0)

    # Output order: the module's state_dict order, then anything the module did not list.
    order = [n for n in ckpt.module_order if n in shapes or n in ckpt.shared]
    order += [n for n in shapes if n not in set(order)]
    aliases: dict[str, str] = {}
    tensor_names: list[str] = []
    for name in order:
        if name in ckpt.shared:
            target = ckpt.shared[name]
            if target not in shapes:  # excluded (frozen) target: the alias goes too
                continue
            if options.tied == "copy":
                tensor_names.append(name)
            else:
                aliases[name] = target
        else:
            tensor_names.append(name)

    slots = builder.resolve()
    out_dtype = options.dtype
    specs: list[TensorSpec] = []
    shard = 0
    shard_bytes = 0
    for name in tensor_names:
        owner = ckpt.shared.get(name, name)
        src = src_dtypes[owner]
        dst_dtype = out_dtype if dtype_info(src).is_floating else src
        nbytes = _numel(shapes[owner]) * dtype_info(dst_dtype).itemsize
        if shard_bytes and shard_bytes + nbytes > options.max_shard_bytes:
            shard += 1
            shard_bytes = 0
        shard_bytes += nbytes
        specs.append(
            TensorSpec(
                index=len(specs), name=name, shape=shapes[owner],
                role="tied" if owner != name else roles[name],
                src_dtype=src, out_dtype=dst_dtype, shard=shard,
                alias_of=owner if owner != name else None,
            )
        )  # fmt: skip
    for spec in specs:
        owner = spec.alias_of or spec.name
        frags = sorted(param_fragments.get(owner, []), key=lambda x: x[3])
        covered = 0
        for slot, src_offset, numel, dst in frags:
            if dst != covered or src_offset + numel > slots[slot].numel:
                raise LayoutMismatchError(
                    f"{ckpt.tag_url}: '{owner}' fragments do not tile it (gap or overlap at "
                    f"element {covered}); the checkpoint's layout is not understood"
                )
            covered += numel
            rows.append((spec.index, slot, src_offset, numel, dst))
        if covered != spec.numel:
            raise LayoutMismatchError(
                f"{ckpt.tag_url}: '{owner}' has {spec.numel} elements but its fragments hold {covered}"
            )

    num_shards = shard + 1 if specs else 0
    shards = []
    for index in range(num_shards):
        members = [s for s in specs if s.shard == index]
        shards.append(
            ShardSpec(
                index=index, file_name=shard_file_name(index, num_shards),
                first_tensor=members[0].index, num_tensors=len(members),
                data_bytes=sum(s.out_nbytes for s in members),
            )
        )  # fmt: skip

    notes = list(ckpt.notes)
    if options.exclude_frozen and ckpt.frozen:
        names = [fp.name for fp in ckpt.frozen]
        notes.append(
            f"{len(names)} frozen param(s) left out of the output (`exclude_frozen`, "
            f"--exclude-frozen): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
        )
    oversized = [s for s in specs if s.out_nbytes > options.max_shard_bytes]
    if oversized:
        big = max(oversized, key=lambda s: s.out_nbytes)
        notes.append(
            f"{len(oversized)} tensor(s) exceed the shard size of {options.max_shard_bytes} bytes "
            f"and get a file of their own, the largest '{big.name}' ({big.out_nbytes} bytes); "
            "safetensors files never split a tensor"
        )
    fragments = FragmentTable.from_rows(rows)
    used_slots = sorted(set(fragments.slot.tolist()))
    parts = _plan_parts(slots, used_slots, options.extract_part_bytes)
    source = {
        "checkpoint": ckpt.ckpt_url,
        "tag": ckpt.tag,
        "tag_url": ckpt.tag_url,
        "stage": ckpt.stage,
        "optimizer": ckpt.optimizer_kind,
        "world_size": world_size,
        "train_dtype": ckpt.train_dtype,
        "ds_version": ckpt.ds_version,
        "num_params": sum(_numel(s) for g in ckpt.param_groups for _, s in g),
        "checkpoint_bytes": sum(f.identity.size_bytes for f in ckpt.files),
        "files": _source_identity(ckpt),
        "content_sha256": content_fingerprint(ckpt),
    }
    plan = Plan(
        plan_id=job_key(ckpt, options),
        source=source,
        options=options.identity(),
        files=builder.files,
        slots=slots,
        tensors=specs,
        shards=shards,
        parts=parts,
        fragments=fragments,
        aliases=aliases,
        notes=notes,
        warnings=list(ckpt.warnings),
    )
    check_module_copy_sample(ckpt, plan)
    return plan


def _plan_parts(slots: list[Slot], used: list[int], part_bytes: int) -> list[ExtractPart]:
    """Group the used slots by rank into extract parts of at most `part_bytes` each."""
    by_rank: dict[int, list[Slot]] = {}
    for index in used:
        by_rank.setdefault(slots[index].rank, []).append(slots[index])
    parts: list[ExtractPart] = []
    for rank in sorted(by_rank):
        groups: list[list[tuple[int, int, int]]] = [[]]
        room = part_bytes
        for slot in by_rank[rank]:
            start = 0
            while True:
                count = min(slot.numel - start, room // slot.itemsize)
                if count == 0 and slot.numel > start:
                    groups.append([])  # this part is full: start the next one
                    room = part_bytes
                    continue
                groups[-1].append((slot.index, start, count))
                room -= count * slot.itemsize
                start += count
                if start >= slot.numel:
                    break
        for number, pieces in enumerate(g for g in groups if g):
            name = f"rank{rank:05d}-part{number:04d}.safetensors"
            parts.append(
                ExtractPart(index=len(parts), rank=rank, file_name=name, pieces=tuple(pieces))
            )
    return parts


# -- persistence ----------------------------------------------------------------------------------

_TABLES = ("files", "slots", "tensors", "shards")


def _rows_to_parquet(rows: list[Any], cls: type) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: dict[str, list[Any]] = {f.name: [] for f in fields(cls)}
    for row in rows:
        for f in fields(cls):
            value = getattr(row, f.name)
            columns[f.name].append(json.dumps(value) if isinstance(value, tuple) else value)
    table = pa.table(columns) if rows else pa.table({k: pa.array([], pa.string()) for k in columns})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _parquet_to_rows(data: bytes, cls: type) -> list[Any]:
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(data))
    cols = table.to_pydict()
    n = table.num_rows
    tuple_fields = {"shape", "pieces"}
    out = []
    for i in range(n):
        kwargs = {}
        for f in fields(cls):
            value = cols[f.name][i]
            if f.name in tuple_fields:
                value = json.loads(value)
                value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
            kwargs[f.name] = value
        out.append(cls(**kwargs))
    return out


_ROW_TABLES: tuple[tuple[str, type], ...] = (
    ("files", SourceFile),
    ("slots", Slot),
    ("tensors", TensorSpec),
    ("shards", ShardSpec),
    ("parts", ExtractPart),
)
"""The plan's row tables: a `Plan` attribute, saved as `<name>.parquet` of `cls` rows."""


def save_plan(plan: Plan, storage: Storage, folder_url: str) -> None:
    """Write the plan as Parquet tables plus `plan.json` (written last: its presence means
    the plan is whole)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    storage.makedirs(folder_url)
    for name, cls in _ROW_TABLES:
        storage.write_bytes(
            join_url(folder_url, f"{name}.parquet"), _rows_to_parquet(getattr(plan, name), cls)
        )
    table = pa.table({c: getattr(plan.fragments, c) for c in FragmentTable.COLUMNS})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    storage.write_bytes(join_url(folder_url, "fragments.parquet"), buf.getvalue())
    head = {
        "plan_format": PLAN_FORMAT,
        "plan_id": plan.plan_id,
        "created_by": plan.created_by,
        "source": plan.source,
        "options": plan.options,
        "aliases": plan.aliases,
        "notes": plan.notes,
        "warnings": plan.warnings,
    }
    storage.write_bytes(join_url(folder_url, "plan.json"), json.dumps(head, indent=1).encode())


def load_plan(storage: Storage, folder_url: str) -> Plan:
    """Read a plan written by `save_plan`."""
    import pyarrow.parquet as pq

    head = json.loads(storage.read_bytes(join_url(folder_url, "plan.json")))
    if head.get("plan_format") != PLAN_FORMAT:
        raise CheckpointFormatError(
            f"{folder_url}: plan format {head.get('plan_format')} is not {PLAN_FORMAT}"
        )
    tables: dict[str, list[Any]] = {}
    for name, cls in _ROW_TABLES:
        tables[name] = _parquet_to_rows(
            storage.read_bytes(join_url(folder_url, f"{name}.parquet")), cls
        )
    frag = pq.read_table(io.BytesIO(storage.read_bytes(join_url(folder_url, "fragments.parquet"))))
    fragments = FragmentTable(
        *(np.asarray(frag.column(c).to_numpy(), dtype=np.int64) for c in FragmentTable.COLUMNS)
    )
    return Plan(
        plan_id=head["plan_id"],
        source=head["source"],
        options=head["options"],
        aliases=head["aliases"],
        notes=head["notes"],
        warnings=head["warnings"],
        created_by=head["created_by"],
        fragments=fragments,
        **tables,
    )


def plan_summary(plan: Plan) -> dict[str, Any]:
    """A JSON-able summary for `inspect` and run reports."""
    return {
        "plan_id": plan.plan_id,
        "source": {k: v for k, v in plan.source.items() if k != "files"},
        "options": plan.options,
        "num_tensors": len(plan.tensors),
        "num_shards": len(plan.shards),
        "num_fragments": len(plan.fragments),
        "fp32_bytes": plan.fp32_bytes,
        "read_bytes": plan.slot_bytes,
        "output_bytes": plan.total_out_bytes,
        "aliases": plan.aliases,
        "notes": plan.notes,
        "warnings": plan.warnings,
    }
