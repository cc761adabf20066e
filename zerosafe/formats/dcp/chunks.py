"""Where the elements of a PyTorch DCP chunk sit in the global tensor: pure integer math.

A DCP tensor (`TensorStorageMetadata`, torch/distributed/checkpoint/metadata.py) has a global
`size` and a list of chunks, each an N-dimensional box given by `offsets` and `sizes`. A chunk
is stored as its own contiguous row-major tensor of shape `sizes`. In the global row-major
(flattened) tensor the chunk's elements form *runs*: if the chunk spans every dimension after
dimension `j` in full, then `prod(sizes[j:])` consecutive chunk elements are consecutive in the
global tensor too, and the chunk is `prod(sizes[:j])` such runs. A dim-0 shard (FSDP2) is one
run; a dim-1 shard (tensor parallel) is one run per row.

Nothing here touches files: the functions take shapes and return runs, so they can be tested on
plain integers (tests/formats/dcp/test_chunks.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from zerosafe.errors import LayoutMismatchError

__all__ = ["ChunkBox", "ChunkRuns", "check_chunk_cover", "chunk_runs", "row_major_strides"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkBox:
    """One chunk of a tensor: where it starts and how large it is, per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkRuns:
    """A chunk as `count` runs of `run_numel` elements each.

    Run `i` is chunk elements `[i * run_numel, (i + 1) * run_numel)` (row-major inside the
    chunk) and global elements `[dst_offsets[i], dst_offsets[i] + run_numel)`.
    """

    run_numel: int
    dst_offsets: np.ndarray
    """int64, ascending."""

    @property
    def count(self) -> int:
        return len(self.dst_offsets)

    @property
    def numel(self) -> int:
        return self.count * self.run_numel

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        """`(chunk_element_offset, numel, dst_element_offset)` of every run, in order."""
        for i, dst in enumerate(self.dst_offsets.tolist()):
            yield i * self.run_numel, self.run_numel, int(dst)


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major tensor of `shape`."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


def _check_box(global_size: Sequence[int], box: ChunkBox, where: str) -> None:
    if len(box.offsets) != len(global_size) or len(box.sizes) != len(global_size):
        raise LayoutMismatchError(
            f"{where}: a chunk has offsets {list(box.offsets)} and sizes {list(box.sizes)} for "
            f"a tensor of size {list(global_size)}; expected {len(global_size)} dimensions each. "
            "The checkpoint's metadata is corrupt."
        )
    for d, (off, size, full) in enumerate(zip(box.offsets, box.sizes, global_size, strict=True)):
        if off < 0 or size < 0 or off + size > full:
            raise LayoutMismatchError(
                f"{where}: a chunk with offsets {list(box.offsets)} and sizes "
                f"{list(box.sizes)} reaches element {off + size} of dimension {d}, which has "
                f"{full}; the checkpoint's metadata is corrupt."
            )


def chunk_runs(global_size: Sequence[int], box: ChunkBox, *, where: str = "") -> ChunkRuns:
    """The runs of contiguous global elements that one chunk holds, in chunk order.

    Args:
        global_size: The tensor's full shape.
        box: The chunk's offsets and sizes (same number of dimensions).
        where: Names the tensor in error messages.

    Returns:
        The chunk's runs; an empty chunk has none.

    Raises:
        LayoutMismatchError: If the chunk does not fit inside the tensor.
    """
    _check_box(global_size, box, where)
    ndim = len(global_size)
    if box.numel == 0:
        return ChunkRuns(run_numel=0, dst_offsets=np.zeros(0, dtype=np.int64))
    # The last dimension the chunk does not span in full: everything after it is contiguous.
    split = -1
    for d in range(ndim - 1, -1, -1):
        if box.sizes[d] != global_size[d]:
            split = d
            break
    strides = row_major_strides(global_size)
    if split == -1:
        return ChunkRuns(run_numel=box.numel, dst_offsets=np.zeros(1, dtype=np.int64))
    run_numel = math.prod(box.sizes[split:])
    base = sum(o * s for o, s in zip(box.offsets, strides, strict=True))
    dst = np.full(1, base, dtype=np.int64)
    for d in range(split):  # the outer dimensions enumerate the runs, row-major
        steps = np.arange(box.sizes[d], dtype=np.int64) * strides[d]
        dst = (dst[:, None] + steps[None, :]).reshape(-1)
    return ChunkRuns(run_numel=run_numel, dst_offsets=dst)


def check_chunk_cover(
    global_size: Sequence[int], boxes: Sequence[ChunkBox], *, where: str = ""
) -> list[ChunkRuns]:
    """Check that the chunks tile the tensor exactly once, and return each chunk's runs.

    Args:
        global_size: The tensor's full shape.
        boxes: Its chunks.
        where: Names the tensor in error messages.

    Returns:
        `chunk_runs` of each chunk, in the order given.

    Raises:
        LayoutMismatchError: If a chunk lies outside the tensor, two chunks overlap, or some
            elements belong to no chunk.
    """
    runs = [chunk_runs(global_size, box, where=where) for box in boxes]
    total = math.prod(global_size)
    starts = np.concatenate([r.dst_offsets for r in runs] or [np.zeros(0, np.int64)])
    lengths = np.concatenate(
        [np.full(r.count, r.run_numel, dtype=np.int64) for r in runs] or [np.zeros(0, np.int64)]
    )
    owners = np.concatenate(
        [np.full(r.count, i, dtype=np.int64) for i, r in enumerate(runs)] or [np.zeros(0, np.int64)]
    )
    order = np.argsort(starts, kind="stable")
    starts, lengths, owners = starts[order], lengths[order], owners[order]
    ends = starts + lengths
    overlap = np.nonzero(starts[1:] < ends[:-1])[0]
    if len(overlap):
        i = int(overlap[0])
        a, b = boxes[int(owners[i])], boxes[int(owners[i + 1])]
        at = _coordinates(int(starts[i + 1]), global_size)
        raise LayoutMismatchError(
            f"{where}: chunks overlap at element {list(at)} of a tensor of size "
            f"{list(global_size)}: one at offsets {list(a.offsets)} sizes {list(a.sizes)}, "
            f"another at offsets {list(b.offsets)} sizes {list(b.sizes)}. Each element must be "
            "saved exactly once; the checkpoint's metadata is corrupt or was merged from "
            "different saves."
        )
    covered = int(lengths.sum())
    if covered != total:
        gap = _first_gap(starts, ends, total)
        raise LayoutMismatchError(
            f"{where}: the chunks hold {covered} of the {total} elements of a tensor of size "
            f"{list(global_size)}; element {list(_coordinates(gap, global_size))} is in no "
            "chunk. Was a rank's save lost, or the checkpoint copied in part?"
        )
    return runs


def _first_gap(starts: np.ndarray, ends: np.ndarray, total: int) -> int:
    expected = 0
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        if start > expected:
            return expected
        expected = max(expected, end)
    return expected if expected < total else 0


def _coordinates(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(flat % size if size else 0)
        flat = flat // size if size else 0
    return tuple(reversed(coords))
