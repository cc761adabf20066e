"""DeepSpeed ZeRO (stages 1, 2, 3) as a format reader: open a tag folder (plain data
parallel, model-parallel ranks or pipeline stages, by its listing) and lay a `ZeroCheckpoint`
out as a `SourceLayout`.

Where each param's elements sit: the fp32 master partitions of every rank
(`zerosafe.formats.deepspeed.layout` does the integer math; MoE expert groups are partitioned
over expert-data-parallel groups, `zerosafe.formats.deepspeed.moe`), frozen params in the model
states (ZeRO-3: one fragment per rank; frozen MoE experts in their expert files), buffers in
rank 0's model states. See docs/formats.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

from zerosafe.config import ConvertOptions
from zerosafe.errors import LayoutMismatchError
from zerosafe.formats.base import (
    Fragment,
    LowpWitness,
    SourceDescription,
    SourceLayout,
    SourceTensor,
)
from zerosafe.formats.deepspeed.facts import content_fingerprint, source_block, zero_facts
from zerosafe.formats.deepspeed.files import find_tag_dir, load_plain_files, scan_files
from zerosafe.formats.deepspeed.layout import split_by_segments, zero3_pieces
from zerosafe.formats.deepspeed.lowp import zero_lowp_witness
from zerosafe.formats.deepspeed.masters import SWAP_FOLDER, is_master_swap, swap_folder_url
from zerosafe.formats.deepspeed.model_parallel import model_parallel_urls, open_model_parallel
from zerosafe.formats.deepspeed.pipeline import open_pipeline, pipeline_layout
from zerosafe.formats.deepspeed.rank_files import open_rank_files
from zerosafe.formats.deepspeed.save_identity import check_module_copy_sample, lowp_copy_missing
from zerosafe.formats.deepspeed.slots import (
    SlotBuilder,
    add_piece,
    buffer_tensor,
    frozen_tensor,
    metadata_bytes_of,
    zero12_fragments,
)
from zerosafe.formats.deepspeed.types import PipelineCheckpoint, ZeroCheckpoint
from zerosafe.formats.deepspeed.universal import FORMAT_NAME as UNIVERSAL
from zerosafe.io.storage import FileIdentity, Storage, join_url, normalize_url

__all__ = ["DeepSpeedReader", "content_fingerprint", "open_tag", "tag_identities", "zero_layout"]


class DeepSpeedReader:
    """DeepSpeed ZeRO checkpoints: `CKPT_DIR/latest` and tag folders of per-rank files."""

    name = "deepspeed"
    title = "DeepSpeed ZeRO"
    looks_like = "a folder holding `latest`, or a tag folder holding `*_model_states.pt`"
    selects = False
    parts_below: tuple[str, ...] = ("deepspeed", UNIVERSAL)
    tag_folders = True

    def __init__(
        self, errors: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    ) -> None:
        self.errors = errors
        """Wraps reading: the registry's `formats_listed` adds the formats zerosafe reads to
        the error for a folder that holds no checkpoint."""

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
    ) -> tuple[str, list[FileIdentity]]:
        with self.errors():
            return tag_identities(storage, url, tag)

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        with self.errors():
            return zero_layout(open_tag(storage, url, tag=tag), options)

    def lowp_witness(
        self, storage: Storage, source: SourceDescription, *, layout: SourceLayout | None = None
    ) -> LowpWitness:
        """ZeRO-1/2's 16-bit module copies (`ReadsLowpCopies`)."""
        ckpt = layout.native if layout is not None else None
        if not isinstance(ckpt, ZeroCheckpoint | PipelineCheckpoint):
            with self.errors():  # the tag folder itself, else the checkpoint folder and tag
                ckpt = (
                    open_tag(storage, source.tag_url)
                    if source.tag_url
                    else open_tag(storage, source.checkpoint, tag=source.tag)
                )
        return zero_lowp_witness(ckpt)


def zero_layout(ckpt: ZeroCheckpoint | PipelineCheckpoint, options: ConvertOptions) -> SourceLayout:
    """Slots and fragments of every tensor of `ckpt`. Reads only zip local headers.

    Raises:
        LayoutMismatchError: If the partitions do not hold exactly the params they should.
    """
    if isinstance(ckpt, PipelineCheckpoint):
        return pipeline_layout(ckpt, options)
    builder = SlotBuilder(ckpt)
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
        zero12_fragments(ckpt, fp32_slot, fragments)
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
            tensors[fp.name] = frozen_tensor(
                ckpt, builder, fp.name, fp.shape, fp.dtype, fp.pieces, fp.url
            )
    for name, t in ckpt.buffers:
        tensors[name] = buffer_tensor(ckpt, builder, name, t)
    layout = SourceLayout(
        format=DeepSpeedReader.name, where=ckpt.tag_url, tag=ckpt.tag,
        files=builder.files, slots=builder.resolve(), tensors=tensors,
        order=list(ckpt.module_order), aliases=dict(ckpt.shared),
        source=source_block(ckpt), facts=zero_facts(ckpt),
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


def _zero3_group_fragments(
    ckpt: ZeroCheckpoint, fp32_slot: dict[tuple[int, int], int], out: dict[str, list[Fragment]]
) -> None:
    """ZeRO-3 with MoE: each sub-group partitioned on its own over its ranks,
    `ceil(numel / count)` elements of each param per rank, laid end to end."""
    for group in ckpt.flat_groups:
        pieces, _ = zero3_pieces([p.numel for p in group.params], len(group.parts))
        for piece in pieces:
            add_piece(out, group.params[piece.param], fp32_slot[group.parts[piece.rank]], piece)


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


def tag_identities(
    storage: Storage, ckpt_url: str, tag: str | None
) -> tuple[str, list[FileIdentity]]:
    """`(tag, identities)` of the files a conversion reads, from listings and stats only.

    The same files, in the same order, as `ZeroCheckpoint.files` for a valid checkpoint, so a
    job key computed from them matches a finished conversion's without opening any file.
    """
    tag, tag_url = find_tag_dir(storage, ckpt_url, tag)
    found = scan_files(storage, tag_url)
    if found.model_parallel:
        urls = model_parallel_urls(found)
        return tag, [storage.identity(u) for u in urls]
    optim, model = found.optim[0], found.model[0]
    urls = [optim[r] for r in sorted(optim)] + [model[r] for r in sorted(model)]
    urls += [found.experts[k] for k in sorted(found.experts)]
    # NVMe offload: the masters' swap files, as the reader orders them
    if SWAP_FOLDER in found.names:
        for r in sorted(optim):
            folder = swap_folder_url(tag_url, r)
            if storage.isdir(folder):
                urls += [
                    join_url(folder, n)
                    for n in sorted(storage.listdir(folder))
                    if is_master_swap(n)
                ]
    return tag, [storage.identity(u) for u in urls]


def open_tag(
    storage: Storage, ckpt_url: str, *, tag: str | None = None, max_workers: int = 8
) -> ZeroCheckpoint | PipelineCheckpoint:
    """Read and check the metadata of one ZeRO checkpoint tag; reads pickles only
    (`zerosafe.formats.deepspeed.checkpoint.open_zero_checkpoint` tells what it returns and
    raises)."""
    ckpt_url = normalize_url(ckpt_url)
    tag, tag_url = find_tag_dir(storage, ckpt_url, tag)
    found = scan_files(storage, tag_url)
    if found.layers:
        return open_pipeline(storage, ckpt_url, tag, found, max_workers)
    if found.model_parallel:
        return open_model_parallel(storage, ckpt_url, tag, found, max_workers=max_workers)
    optim_by_rank, model_by_rank, expert_files = load_plain_files(storage, found, max_workers)
    return open_rank_files(
        ckpt_url, tag, tag_url, storage, optim_by_rank, model_by_rank, expert_files=expert_files
    )
