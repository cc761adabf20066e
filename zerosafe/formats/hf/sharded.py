"""The tensors of a save by torch's `HuggingFaceStorageWriter(save_distributed=True)`,
reassembled from every rank's slices.

`torch.distributed.checkpoint.save(..., storage_writer=HuggingFaceStorageWriter(DIR,
save_distributed=True))` (torch/distributed/checkpoint/hf_storage.py, torch 2.13) has each
rank write `shard-0000R-model-0000K-of-0000N.safetensors` (R = rank + 1; K of N from
`fqn_to_index_mapping`, 1 of 1 without it): the rank's local chunks under the tensors' full
names, each chunk's place in the global tensor in the header's `__metadata__`
`DCP_SHARDING_INFO` (`{fqn: {"saved_offsets": [...]}}`), no `.metadata`. The global shape is
not recorded: like torch's own consolidation (`_consolidate_hf_safetensors.py`,
`_parse_input_metadata`), it is the largest `offset + size` of each dimension over the chunks.
The chunks must then tile it exactly once (`zerosafe.formats.dcp.chunks.check_chunk_cover`),
and each chunk becomes fragments by the same run geometry as a DCP chunk.

A rank file lost from the middle leaves a gap (refused); the rank numbers in the file names
must run from 1 without a hole. A lost last rank of a dim-0 split cannot be told from the
slices alone (the shape is inferred from what is there): torch's own reader cannot either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from zerosafe.errors import CheckpointFormatError, LayoutMismatchError
from zerosafe.formats.base import Fragment, Slot, SourceFile, SourceTensor
from zerosafe.formats.dcp.chunks import ChunkBox, check_chunk_cover
from zerosafe.formats.hf.headers import HeaderTensor, SafetensorsHeader
from zerosafe.io.storage import Storage

__all__ = ["RANK_FILE", "PlacedChunk", "Reassembled", "place_chunks", "rank_files", "reassemble"]

RANK_FILE = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
SHARDING_KEY = "DCP_SHARDING_INFO"


@dataclass(kw_only=True)
class Reassembled:
    """The global tensors of the rank files, as the reader's `SourceLayout` needs them."""

    tensors: dict[str, SourceTensor] = field(default_factory=dict)
    slots: list[Slot] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    split: int = 0
    """Tensors held in more than one chunk."""


def rank_files(storage: Storage, url: str) -> tuple[int, list[tuple[int, str]]]:
    """`(world size, [(rank, file name)])` of the rank files, in rank then file order.

    Raises:
        CheckpointFormatError: If there is none, the files disagree on N, or a rank is missing.
    """
    found: list[tuple[int, int, int, str]] = []
    for name in storage.listdir(url):
        match = RANK_FILE.match(name)
        if match:
            found.append((int(match.group(1)), int(match.group(2)), int(match.group(3)), name))
    if not found:
        raise CheckpointFormatError(
            f"{url}: no shard-0000R-model-0000K-of-0000N.safetensors file; not a save of "
            "torch's HuggingFaceStorageWriter(save_distributed=True)"
        )
    counts = {n for _, _, n, _ in found}
    if len(counts) > 1:
        raise CheckpointFormatError(
            f"{url}: rank files name {sorted(counts)} files per rank (-of-N): saves of "
            "different runs share this folder; move the files of one save into a folder of its own"
        )
    ranks = sorted({r for r, _, _, _ in found})
    world_size = max(ranks)
    missing = [r for r in range(1, world_size + 1) if r not in ranks]
    if missing or min(ranks) < 1:
        names = ", ".join(f"shard-{r:05d}-model-*.safetensors" for r in missing[:4])
        raise CheckpointFormatError(
            f"{url}: the rank files run to shard-{world_size:05d} but {names or 'shard-00000'} "
            f"{'are' if len(missing) > 1 else 'is'} {'missing' if missing else 'unexpected'} "
            "(torch numbers ranks from 1); each rank writes its own file, so the save did not "
            "finish or was copied in part. Copy the whole folder again"
        )
    found.sort()
    return world_size, [(r - 1, name) for r, _, _, name in found]


def _offsets(header: SafetensorsHeader) -> dict[str, list[int]]:
    raw = header.metadata.get(SHARDING_KEY)
    if raw is None:
        raise CheckpointFormatError(
            f"{header.url}: no `{SHARDING_KEY}` in `__metadata__`, which "
            "HuggingFaceStorageWriter writes into every rank file to place its chunks; the "
            "file was not written by torch.distributed.checkpoint, or was rewritten since"
        )
    try:
        info = json.loads(raw)
        offsets = {str(k): [int(o) for o in v["saved_offsets"]] for k, v in info.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointFormatError(
            f"{header.url}: `{SHARDING_KEY}` is {raw[:120]!r}, expected "
            '`{fqn: {"saved_offsets": [...]}}`; the file is corrupt'
        ) from e
    unplaced = sorted(set(header.tensors) - set(offsets))
    if unplaced:
        raise CheckpointFormatError(
            f"{header.url}: tensor(s) {unplaced[:4]} have no saved_offsets in `{SHARDING_KEY}`; "
            "the file is corrupt"
        )
    return offsets


def _global_size(where: str, chunks: Sequence[tuple[HeaderTensor, list[int], int]]) -> list[int]:
    first = chunks[0][0]
    size = [0] * len(first.shape)
    for tensor, offsets, rank in chunks:
        if (tensor.dtype, len(tensor.shape), len(offsets)) != (
            first.dtype,
            len(first.shape),
            len(first.shape),
        ):
            raise CheckpointFormatError(
                f"{where}: rank {rank} holds a {tensor.dtype} chunk of {list(tensor.shape)} at "
                f"offsets {offsets}, and rank {chunks[0][2]} a {first.dtype} chunk of "
                f"{list(first.shape)}; the chunks of one tensor share its dtype and dimensions. "
                "The rank files come from different saves"
            )
        for d, (o, s) in enumerate(zip(offsets, tensor.shape, strict=True)):
            size[d] = max(size[d], o + s)
    return size


def reassemble(
    url: str, headers: Sequence[SafetensorsHeader], files: Sequence[SourceFile]
) -> Reassembled:
    """Every global tensor of the rank files, as fragments of slots (the stored chunks).

    Args:
        url: The folder, for messages.
        headers: The rank files' checked headers, in `files` order.
        files: The rank files as `SourceFile`s (their `rank` places the chunks).

    Raises:
        CheckpointFormatError: If a chunk has no offsets, or the chunks of a tensor disagree
            on dtype or dimensions, overlap or leave a gap.
    """
    chunks: dict[str, list[PlacedChunk]] = {}
    for header, file in zip(headers, files, strict=True):
        placed = _offsets(header)
        for name, tensor in header.tensors.items():
            chunks.setdefault(name, []).append(
                PlacedChunk(tensor=tensor, offsets=tuple(placed[name]), file=file)
            )
    sizes = {
        name: _global_size(
            f"{url}: '{name}'", [(c.tensor, list(c.offsets), c.file.rank) for c in pieces]
        )
        for name, pieces in chunks.items()
    }
    return place_chunks(
        url, chunks, sizes,
        inferred=" (the shape is inferred from the chunks, as torch's consolidation does)",
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacedChunk:
    """One rank file's tensor and where it sits in the global tensor."""

    tensor: HeaderTensor
    offsets: tuple[int, ...]
    file: SourceFile


def place_chunks(
    url: str,
    chunks: Mapping[str, Sequence[PlacedChunk]],
    sizes: Mapping[str, Sequence[int]],
    *,
    inferred: str = "",
) -> Reassembled:
    """Global tensors of the given sizes from chunks of safetensors rank files: the chunks must
    tile each tensor exactly once (`check_chunk_cover`), and each becomes a slot whose runs are
    the tensor's fragments (the run geometry of a DCP chunk).

    Args:
        url: The folder, for messages.
        chunks: Tensor name -> its chunks.
        sizes: Tensor name -> its global shape.
        inferred: Said after a cover error, where the shapes came from.

    Raises:
        CheckpointFormatError: If the chunks of a tensor overlap, leave a gap or do not fit.
    """
    built = Reassembled()
    for name in sorted(chunks):
        where = f"{url}: '{name}'"
        pieces = chunks[name]
        size = list(sizes[name])
        boxes = [ChunkBox(offsets=c.offsets, sizes=c.tensor.shape) for c in pieces]
        try:
            runs = check_chunk_cover(size, boxes, where=where)
        except LayoutMismatchError as e:
            raise CheckpointFormatError(f"{e.args[0]}{inferred}") from e
        fragments: list[Fragment] = []
        for chunk, chunk_runs in zip(pieces, runs, strict=True):
            tensor, file = chunk.tensor, chunk.file
            if not tensor.numel:
                continue
            slot = len(built.slots)
            built.slots.append(
                Slot(
                    index=slot, file=file.index, rank=file.rank, kind="chunk",
                    name=f"{name}@{','.join(map(str, chunk.offsets))}", record=name,
                    record_offset=tensor.byte_offset, record_size_bytes=tensor.nbytes,
                    record_crc32=0, element_offset=0, numel=tensor.numel, dtype=tensor.dtype,
                )
            )  # fmt: skip
            fragments += [(slot, src, n, dst) for src, n, dst in chunk_runs]
        fragments.sort(key=lambda f: f[3])
        built.split += len(pieces) > 1
        built.order.append(name)
        built.tensors[name] = SourceTensor(
            name=name, shape=tuple(size), dtype=pieces[0].tensor.dtype, role="param",
            fragments=tuple(fragments),
        )  # fmt: skip
    return built
