"""The conversion plan: every output tensor as a list of byte-range fragments of source slots.

A *slot* is one contiguous run of elements in one source file (a rank's fp32 partition, a
frozen fragment, a buffer). A *fragment* copies `numel` elements from a slot, starting at
`src_offset`, to `dst_offset` in an output tensor. Fragments of a tensor tile it exactly, in
order, so merging is a sequence of range copies. Output tensors are assigned to *shards*
(output files) greedily by `max_shard_size`; in staged mode, slots are copied to
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
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from zerosafe._version import __version__
from zerosafe.config import ConvertOptions
from zerosafe.dtypes import dtype_info
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.base import SourceDescription
from zerosafe.io.storage import Storage, join_url

__all__ = [
    "PLAN_FORMAT",
    "PACKED_ROLE",
    "SCALE_ROLE",
    "ExtractPart",
    "FragmentTable",
    "Plan",
    "ShardSpec",
    "Slot",
    "SourceFile",
    "TensorSpec",
    "job_key_of",
    "load_plan",
    "save_plan",
    "shard_file_name",
]

log = logging.getLogger(__name__)

PLAN_FORMAT = 1
SCALE_ROLE = "scale"
"""`TensorSpec.role` of a quantized weight's scales (`zerosafe.quantize`), the tensor after it."""
PACKED_ROLE = "packed"
"""`TensorSpec.role` of a quantized weight stored under another name and shape: NVFP4's
`<module>.weight_packed`, two values a byte, read from `<module>.weight`."""


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
    """`param`, `frozen`, `buffer`, `tied` (an alias written as a copy), or `scale` (the
    scales of the quantized weight before it, computed by the merge)."""
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

    @property
    def quantized(self) -> bool:
        """Whether this is a quantized weight's values (`--quantize`: FP8, or NVFP4 packed);
        its scales follow it."""
        return self.role == PACKED_ROLE or (
            self.out_dtype == "float8_e4m3fn" and self.role != SCALE_ROLE
        )

    @property
    def source_name(self) -> str:
        """The checkpoint tensor this one is read from (an alias's own name stays)."""
        return self.name.removesuffix("_packed") if self.role == PACKED_ROLE else self.name

    @property
    def source_shape(self) -> tuple[int, ...]:
        """The shape of the values read for it: NVFP4 packs two a byte."""
        if self.role == PACKED_ROLE:
            return (*self.shape[:-1], self.shape[-1] * 2)
        return self.shape


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

    job_key: str
    """Hash of the source identity, the byte-affecting options and zerosafe's plan format."""
    source: SourceDescription
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
    quantization: dict[str, Any] | None = None
    """`--quantize`: the `quantization_config` the copied `config.json` gets."""
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
        "job_key": plan.job_key,
        "created_by": plan.created_by,
        "source": plan.source.to_json(),
        "reader": plan.source.reader_json(),
        "options": plan.options,
        "aliases": plan.aliases,
        "notes": plan.notes,
        "warnings": plan.warnings,
        **({"quantization": plan.quantization} if plan.quantization is not None else {}),
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
        job_key=head["job_key"],
        source=SourceDescription.from_json(head["source"], head.get("reader")),
        options=head["options"],
        aliases=head["aliases"],
        notes=head["notes"],
        warnings=head["warnings"],
        quantization=head.get("quantization"),
        created_by=head["created_by"],
        fragments=fragments,
        **tables,
    )
