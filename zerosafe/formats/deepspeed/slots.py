"""Slots and fragments of a ZeRO checkpoint's tensors, shared by the readers of each layout
(`reader` for ZeRO-1/2/3, `pipeline`, `universal`): where each record sits in which file, and
which of its elements make which tensor."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.base import Fragment, Slot, SourceFile, SourceTensor, record_slot
from zerosafe.formats.deepspeed.layout import GroupParam, Piece, map_runs, zero12_partition_pieces
from zerosafe.formats.deepspeed.types import LoadedFile, SwapFile, ZeroCheckpoint
from zerosafe.formats.torch_pickle import TensorRecord

__all__ = [
    "SlotBuilder",
    "add_piece",
    "buffer_tensor",
    "frozen_tensor",
    "metadata_bytes_of",
    "swap_files",
    "zero12_fragments",
]


def metadata_bytes_of(files: Iterable[LoadedFile]) -> int:
    """What reading `files`' metadata costs, each pickle and zip directory
    (`SourceLayout.metadata_bytes`)."""
    return sum(
        f.zip.records[f.zip.prefix + "data.pkl"].size_bytes + f.zip.directory_bytes for f in files
    )


def zero12_fragments(
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
            add_piece(out, group.params[piece.param], fp32_slot[group.parts[piece.rank]], piece)


def add_piece(out: dict[str, list[Fragment]], param: GroupParam, slot: int, piece: Piece) -> None:
    """A piece of `param`'s elements from `slot`, placed where they go in its output tensor."""
    for dst, delta, count in map_runs(param.runs, piece.dst_offset, piece.numel):
        out.setdefault(param.name, []).append((slot, piece.src_offset + delta, count, dst))


def frozen_tensor(
    ckpt: ZeroCheckpoint,
    builder: SlotBuilder,
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


def buffer_tensor(
    ckpt: ZeroCheckpoint, builder: SlotBuilder, name: str, t: TensorRecord
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


def swap_files(ckpt: ZeroCheckpoint) -> list[SwapFile]:
    return sorted(ckpt.swapped.values(), key=lambda w: (w.rank, w.url))


@dataclass
class SlotBuilder:
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
        for w in swap_files(self.ckpt):  # files in a fixed order, whatever the slot order
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
        return record_slot(
            loaded.zip, t, where=f"{loaded.url}: tensor '{name}'", index=index,
            file=self._file_index[loaded.url], rank=loaded.rank, kind=kind, name=name,
        )  # fmt: skip
