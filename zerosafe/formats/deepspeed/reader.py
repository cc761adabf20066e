"""DeepSpeed ZeRO (stages 1, 2, 3) as a format reader: a `ZeroCheckpoint` -> `SourceLayout`.

Where each param's elements sit: the fp32 master partitions of every rank
(`zerosafe.formats.deepspeed.layout` does the integer math; MoE expert groups are partitioned
over expert-data-parallel groups, `zerosafe.formats.deepspeed.moe`), frozen params in the model
states (ZeRO-3: one fragment per rank; frozen MoE experts in their expert files), buffers in
rank 0's model states. See docs/formats.md.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError, LayoutMismatchError
from zerosafe.formats.base import Fragment, SourceLayout, SourceTensor
from zerosafe.formats.deepspeed.checkpoint import (
    LoadedFile,
    SwapFile,
    ZeroCheckpoint,
    open_zero_checkpoint,
    quick_identities,
)
from zerosafe.formats.deepspeed.layout import (
    GroupParam,
    Piece,
    map_runs,
    split_by_segments,
    zero3_pieces,
    zero12_partition_pieces,
)
from zerosafe.formats.deepspeed.moe import describe_moe
from zerosafe.formats.deepspeed.save_identity import check_module_copy_sample, lowp_copy_missing
from zerosafe.formats.torch_pickle import TensorRecord
from zerosafe.io.storage import FileIdentity, Storage, join_url, normalize_url
from zerosafe.plan.model import Slot, SourceFile
from zerosafe.units import format_bytes

if TYPE_CHECKING:
    from zerosafe.formats.deepspeed.pipeline import PipelineCheckpoint
    from zerosafe.plan.model import Plan

__all__ = ["DeepSpeedReader", "build_plan", "content_fingerprint", "zero_layout"]


class DeepSpeedReader:
    """DeepSpeed ZeRO checkpoints: `CKPT_DIR/latest` and tag folders of per-rank files."""

    name = "deepspeed"
    title = "DeepSpeed ZeRO"
    looks_like = "a folder holding `latest`, or a tag folder holding `*_model_states.pt`"
    selects = False
    lowp_copy = True

    def detect(self, storage: Storage, url: str) -> bool:
        url = normalize_url(url)
        if not storage.isdir(url):
            return False
        names = storage.listdir(url)
        if "latest" in names or any(n.endswith("_model_states.pt") for n in names):
            return True
        return any(
            n.endswith("_model_states.pt")
            for sub in names
            if storage.isdir(join_url(url, sub))
            for n in storage.listdir(join_url(url, sub))
        )

    def quick_identities(
        self, storage: Storage, url: str, tag: str | None
    ) -> tuple[str, list[dict[str, Any]]]:
        return quick_identities(storage, url, tag)

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        return zero_layout(open_zero_checkpoint(storage, url, tag=tag), options)


def metadata_bytes_of(files: Iterable[LoadedFile]) -> int:
    """What reading `files`' metadata costs, each pickle and zip directory
    (`SourceLayout.metadata_bytes`)."""
    return sum(
        f.zip.records[f.zip.prefix + "data.pkl"].size_bytes + f.zip.directory_bytes for f in files
    )


def build_plan(ckpt: ZeroCheckpoint | PipelineCheckpoint, options: ConvertOptions) -> Plan:
    """The plan of converting an opened ZeRO checkpoint (`plan_layout` of its layout)."""
    from zerosafe.plan.build import plan_layout

    return plan_layout(zero_layout(ckpt, options), options)


def zero_layout(ckpt: ZeroCheckpoint | PipelineCheckpoint, options: ConvertOptions) -> SourceLayout:
    """Slots and fragments of every tensor of `ckpt`. Reads only zip local headers.

    Raises:
        LayoutMismatchError: If the partitions do not hold exactly the params they should.
    """
    from zerosafe.formats.deepspeed.pipeline import PipelineCheckpoint, pipeline_layout

    if isinstance(ckpt, PipelineCheckpoint):
        return pipeline_layout(ckpt, options)
    builder = _SlotBuilder(ckpt)
    fragments: dict[str, list[Fragment]] = {}
    fp32_slot = {
        (f.rank, g): (
            builder.add_swap(ckpt.swapped[(f.rank, g)], f"fp32/group{g}")
            if (f.rank, g) in ckpt.swapped
            else builder.add(f, "fp32", f"fp32/group{g}", t)
        )
        for f in ckpt.optim_files
        for g, t in enumerate(ckpt.fp32_partitions[f.rank])
    }
    if ckpt.stage in (1, 2):
        _zero12_fragments(ckpt, fp32_slot, fragments)
    elif ckpt.flat_groups:
        _zero3_group_fragments(ckpt, fp32_slot, fragments)
    else:
        _zero3_fragments(ckpt, fp32_slot, fragments)
    tensors: dict[str, SourceTensor] = {}
    for name, shape in ckpt.trained_params:
        tensors[name] = SourceTensor(
            name=name, shape=shape, dtype=ckpt.master_dtype, role="param",
            fragments=tuple(fragments.get(name, ())),
        )  # fmt: skip
    for name, shape, dtype in ckpt.empty_params:  # shape and no data, whatever the options
        tensors[name] = SourceTensor(
            name=name, shape=shape, dtype=dtype, role="param", fragments=()
        )
    if not options.exclude_frozen:  # their slots cost a header read each: skip when unused
        for fp in ckpt.frozen:
            tensors[fp.name] = _frozen_tensor(
                ckpt, builder, fp.name, fp.shape, fp.dtype, fp.pieces, fp.url
            )
    for name, t in ckpt.buffers:
        tensors[name] = _buffer_tensor(ckpt, builder, name, t)
    layout = SourceLayout(
        format=DeepSpeedReader.name, where=ckpt.tag_url, tag=ckpt.tag,
        files=builder.files, slots=builder.resolve(), tensors=tensors,
        order=list(ckpt.module_order), aliases=dict(ckpt.shared),
        source=_source_block(ckpt), facts=_facts(ckpt),
        metadata_bytes=metadata_bytes_of(ckpt.files),
        notes=list(ckpt.notes), warnings=list(ckpt.warnings),
        checks=(functools.partial(check_module_copy_sample, ckpt),),
        native=ckpt, lowp_missing=lowp_copy_missing(ckpt),
    )  # fmt: skip
    if options.exclude_frozen:  # counted and named by the planner's note
        for fp in ckpt.frozen:
            layout.tensors[fp.name] = SourceTensor(
                name=fp.name, shape=fp.shape, dtype=fp.dtype, role="frozen", fragments=()
            )
    return layout


def _zero12_fragments(
    ckpt: ZeroCheckpoint, fp32_slot: dict[tuple[int, int], int], out: dict[str, list[Fragment]]
) -> None:
    """ZeRO-1/2: each group's params laid end to end (with alignment padding) and cut into
    equal partitions, one per rank of the group (all ranks; an MoE expert group: the ranks of
    one expert-data-parallel group)."""
    for group in ckpt.flat_groups:
        saved = [ckpt.fp32_partitions[r][h].numel for r, h in group.parts]
        pieces = zero12_partition_pieces(
            [p.numel for p in group.params], group.alignment_paddings, group.partition_numel,
            saved, where=f"{ckpt.tag_url}: {group.label}",
        )  # fmt: skip
        for piece in pieces:
            _add_piece(out, group.params[piece.param], fp32_slot[group.parts[piece.rank]], piece)


def _add_piece(out: dict[str, list[Fragment]], param: GroupParam, slot: int, piece: Piece) -> None:
    """A piece of `param`'s elements from `slot`, placed where they go in its output tensor."""
    for dst, delta, count in map_runs(param.runs, piece.dst_offset, piece.numel):
        out.setdefault(param.name, []).append((slot, piece.src_offset + delta, count, dst))


def _zero3_group_fragments(
    ckpt: ZeroCheckpoint, fp32_slot: dict[tuple[int, int], int], out: dict[str, list[Fragment]]
) -> None:
    """ZeRO-3 with MoE: each sub-group partitioned on its own over its ranks,
    `ceil(numel / count)` elements of each param per rank, laid end to end."""
    for group in ckpt.flat_groups:
        pieces, _ = zero3_pieces([p.numel for p in group.params], len(group.parts))
        for piece in pieces:
            _add_piece(out, group.params[piece.param], fp32_slot[group.parts[piece.rank]], piece)


def _zero3_fragments(
    ckpt: ZeroCheckpoint, fp32_slot: dict[tuple[int, int], int], out: dict[str, list[Fragment]]
) -> None:
    """ZeRO-3: every param split in `ceil(numel / world_size)` pieces, one per rank, each
    rank's pieces laid end to end across its sub-group partitions."""
    flat = [(name, shape) for group in ckpt.param_groups for name, shape in group]
    pieces, per_rank = zero3_pieces([math.prod(s) for _, s in flat], ckpt.world_size)
    for rank in range(ckpt.world_size):
        saved_numel = sum(_partition_numels(ckpt, rank))
        if saved_numel != per_rank:
            raise LayoutMismatchError(
                f"{ckpt.optim_files[rank].url}: rank {rank} saved {saved_numel} fp32 elements "
                f"but 'param_shapes' partitioned over {ckpt.world_size} ranks needs exactly "
                f"{per_rank}; was the checkpoint saved with another world size or another model?"
            )
    for piece in pieces:
        segments = _partition_numels(ckpt, piece.rank)
        for seg, seg_offset, count, run_offset in split_by_segments(
            piece.src_offset, piece.numel, segments
        ):
            out.setdefault(flat[piece.param][0], []).append(
                (fp32_slot[(piece.rank, seg)], seg_offset, count, piece.dst_offset + run_offset)
            )


def _partition_numels(ckpt: ZeroCheckpoint, rank: int) -> list[int]:
    """Elements of each of a rank's master partitions, wherever they are kept."""
    return [
        ckpt.swapped[(rank, g)].numel if (rank, g) in ckpt.swapped else t.numel
        for g, t in enumerate(ckpt.fp32_partitions[rank])
    ]


def _frozen_tensor(
    ckpt: ZeroCheckpoint,
    builder: _SlotBuilder,
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    pieces: Sequence[tuple[int, TensorRecord]],
    url: str = "",
) -> SourceTensor:
    """A frozen param: whole in the model states (ZeRO-1/2) or an expert file (`url`), or one
    piece per rank (ZeRO-3)."""
    numel = math.prod(shape)
    fragments: list[Fragment] = []
    dst = 0
    for rank, t in pieces:
        if url:
            loaded = next(f for f in ckpt.files if f.url == url)
        else:
            loaded = next(f for f in ckpt.model_files if f.rank == rank)
        slot = builder.add(loaded, "frozen", f"frozen/{name}", t)
        count = min(t.numel, numel - dst)
        if count > 0:
            fragments.append((slot, 0, count, dst))
        dst += count
    return SourceTensor(
        name=name, shape=shape, dtype=dtype, role="frozen", fragments=tuple(fragments)
    )


def _buffer_tensor(
    ckpt: ZeroCheckpoint, builder: _SlotBuilder, name: str, t: TensorRecord
) -> SourceTensor:
    fragments: tuple[Fragment, ...] = ()
    if t.numel:
        if not t.is_contiguous():
            raise CheckpointFormatError(
                f"{ckpt.model_files[0].url}: buffer '{name}' is not contiguous"
            )
        slot = builder.add(ckpt.model_files[0], "buffer", f"buffer/{name}", t)
        fragments = ((slot, 0, t.numel, 0),)
    return SourceTensor(
        name=name, shape=tuple(t.shape), dtype=t.dtype, role="buffer", fragments=fragments
    )


def _source_block(ckpt: ZeroCheckpoint) -> dict[str, Any]:
    return {
        "checkpoint": ckpt.ckpt_url,
        "tag": ckpt.tag,
        "tag_url": ckpt.tag_url,
        "stage": ckpt.stage,
        "optimizer": ckpt.optimizer_kind,
        "world_size": ckpt.world_size,
        "train_dtype": ckpt.train_dtype,
        "master_dtype": ckpt.master_dtype,
        "optimizer_name": ckpt.optimizer_name,
        "ds_version": ckpt.ds_version,
        "num_params": sum(math.prod(s) for _, s in ckpt.trained_params),
        "checkpoint_bytes": sum(i.size_bytes for i in _identities(ckpt)),
        "files": [i.as_dict() for i in _identities(ckpt)],
        "content_sha256": content_fingerprint(ckpt),
        **({"moe": describe_moe(ckpt.moe)[1]} if ckpt.moe is not None else {}),
    }


def _facts(ckpt: ZeroCheckpoint) -> dict[str, Any]:
    """`inspect`'s DeepSpeed section (its keys predate the format readers: kept as they are)."""
    total = sum(i.size_bytes for i in _identities(ckpt))
    about = [
        f"Checkpoint  {ckpt.ckpt_url}  (DeepSpeed ZeRO, tag {ckpt.tag})",
        f"  ZeRO stage {ckpt.stage}"
        + (" (BF16_Optimizer)" if ckpt.optimizer_kind == "bf16_optimizer" else "")
        + f", trained in {ckpt.train_dtype}, data-parallel world size {ckpt.world_size}, "
        f"DeepSpeed {ckpt.ds_version or 'unknown'}",
        f"  master weights in {ckpt.master_dtype}"
        + (" (low-precision masters)" if ckpt.master_dtype != "float32" else "")
        + f", optimizer {ckpt.optimizer_name}",
        f"  files: {len(ckpt.optim_files)} optimizer + {len(ckpt.model_files)} model states"
        + (f" + {len(ckpt.expert_files)} MoE expert" if ckpt.expert_files else "")
        + (f" + {len(ckpt.swapped)} NVMe swap files" if ckpt.swapped else "")
        + f", {format_bytes(total)} in all",
    ]
    moe = describe_moe(ckpt.moe) if ckpt.moe is not None else None
    if moe is not None:
        about.append(moe[0])
    return {
        "checkpoint": ckpt.ckpt_url,
        "tag": ckpt.tag,
        "zero_stage": ckpt.stage,
        "optimizer": ckpt.optimizer_kind,
        "train_dtype": ckpt.train_dtype,
        "master_dtype": ckpt.master_dtype,
        "optimizer_name": ckpt.optimizer_name,
        "zero_element_params": [n for n, _, _ in ckpt.empty_params],
        "nvme_swap_files": len(ckpt.swapped),
        "world_size": ckpt.world_size,
        "deepspeed_version": ckpt.ds_version,
        "moe": moe[1] if moe is not None else None,
        "files": {
            "optimizer": len(ckpt.optim_files),
            "model_states": len(ckpt.model_files),
            "experts": len(ckpt.expert_files),
            "total_bytes": total,
        },
        "about": about,
        "read_labels": {
            "main": f"{_short(ckpt.master_dtype)} masters",
            "other": "frozen params and buffers",
            "metadata": "pickles and zip directories",
            "never": _never_read(ckpt.optimizer_name),
        },
    }


def _identities(ckpt: ZeroCheckpoint) -> list[FileIdentity]:
    """Every file a conversion reads: optimizer and model states, then NVMe swap files."""
    return [f.identity for f in ckpt.files] + [w.identity for w in _swap_files(ckpt)]


def _swap_files(ckpt: ZeroCheckpoint) -> list[SwapFile]:
    return sorted(ckpt.swapped.values(), key=lambda w: (w.rank, w.url))


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def _never_read(optimizer_name: str) -> str:
    """What `inspect` says is left unread: `AdamW (state exp_avg, exp_avg_sq)` -> Adam moments."""
    state = optimizer_name.partition("(")[2].rstrip(")").removeprefix("state ")
    if state in ("exp_avg, exp_avg_sq", "no state saved", ""):
        return "Adam moments are never read"
    return f"optimizer state ({state}) is never read"


def content_fingerprint(ckpt: ZeroCheckpoint) -> str:
    """SHA-256 over (file name, record name, size, CRC-32) of every record of every file: it
    comes from the zip directories alone, survives copies and moves, and changes with any
    stored tensor (`verify --against` compares it)."""
    h = hashlib.sha256()
    for f in ckpt.files:
        h.update(f.url.rsplit("/", 1)[-1].encode() + b"\0")
        for name, record in sorted(f.zip.records.items()):
            short = name.split("/", 1)[-1]  # the archive folder is the save's file stem
            h.update(f"{short}\0{record.size_bytes}\0{record.crc32}\n".encode())
    for swap in _swap_files(ckpt):  # raw files without a CRC: their names and sizes
        name = "/".join(swap.url.rsplit("/", 2)[-2:])
        h.update(f"{name}\0{swap.identity.size_bytes}\n".encode())
    return h.hexdigest()


@dataclass
class _SlotBuilder:
    """Slots as they are found; `resolve` reads their records' zip local headers at once."""

    ckpt: ZeroCheckpoint
    files: list[SourceFile] = field(default_factory=list)
    _file_index: dict[str, int] = field(default_factory=dict)
    _pending: list[tuple[LoadedFile, str, str, TensorRecord] | tuple[SwapFile, str]] = field(
        default_factory=list
    )

    def __post_init__(self) -> None:
        for f in self.ckpt.files:
            self._file_index[f.url] = len(self.files)
            self.files.append(
                SourceFile(
                    index=len(self.files), url=f.url, role=f.role, rank=f.rank,
                    size_bytes=f.identity.size_bytes, version=f.identity.version,
                )
            )  # fmt: skip

    def add(self, loaded: LoadedFile, kind: str, name: str, tensor: TensorRecord) -> int:
        self._pending.append((loaded, kind, name, tensor))
        return len(self._pending) - 1

    def add_swap(self, swap: SwapFile, name: str) -> int:
        """A master partition in an NVMe swap file: raw elements from byte 0, no CRC."""
        for w in _swap_files(self.ckpt):  # files in a fixed order, whatever the slot order
            if w.url not in self._file_index:
                self._file_index[w.url] = len(self.files)
                self.files.append(
                    SourceFile(
                        index=len(self.files), url=w.url, role="swap", rank=w.rank,
                        size_bytes=w.identity.size_bytes, version=w.identity.version,
                    )
                )  # fmt: skip
        self._pending.append((swap, name))
        return len(self._pending) - 1

    def resolve(self, max_workers: int = 8) -> list[Slot]:
        """Read the zip local headers of every slot's record (one small read each)."""
        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            return list(pool.map(self._slot, range(len(self._pending)), self._pending))

    def _slot(
        self, index: int, item: tuple[LoadedFile, str, str, TensorRecord] | tuple[SwapFile, str]
    ) -> Slot:
        if len(item) == 2:
            swap, name = item
            return Slot(
                index=index, file=self._file_index[swap.url], rank=swap.rank, kind="fp32",
                name=name, record=swap.url.rsplit("/", 1)[-1], record_offset=0,
                record_size_bytes=swap.identity.size_bytes, record_crc32=0,
                element_offset=0, numel=swap.numel, dtype=swap.dtype,
            )  # fmt: skip
        loaded, kind, name, t = item
        record = loaded.zip.storage_record(t.storage.key)
        end = (t.storage_offset + t.numel) * t.itemsize
        if end > record.size_bytes:
            raise CheckpointFormatError(
                f"{loaded.url}: tensor '{name}' needs {end} bytes of record "
                f"'{record.name}', which holds {record.size_bytes}; the file is corrupt"
            )
        return Slot(
            index=index, file=self._file_index[loaded.url], rank=loaded.rank, kind=kind,
            name=name, record=record.name, record_offset=loaded.zip.data_offset(record),
            record_size_bytes=record.size_bytes, record_crc32=record.crc32,
            element_offset=t.storage_offset, numel=t.numel, dtype=t.dtype,
        )  # fmt: skip
