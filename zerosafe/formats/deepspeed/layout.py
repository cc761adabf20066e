"""Where each parameter's elements sit in DeepSpeed ZeRO partitions: pure integer math.

ZeRO-1/2 (DeepSpeed `runtime/zero/stage_1_and_2.py`, and `BF16_Optimizer`): the params of one
optimizer group are flattened in `param_shapes` order, each followed by its alignment padding
(`param_alignment_paddings`), and the flat buffer's tail is padded to a multiple of
`2 * world_size`. The buffer is cut into `world_size` equal partitions; rank r saves elements
`[r * P, (r + 1) * P)`, minus padding the checkpoint did not store (`group_paddings`).

ZeRO-3 (`runtime/zero/partition_parameters.py`): each param is split on its own into
`ceil(numel / world_size)` elements per rank (the last pieces padded); on every rank the pieces
follow `param_shapes` order through its flat sub-groups. Frozen ZeRO-3 params are split the
same way, each rank saving its piece as its own tensor.

MoE (DeepSpeed-MoE and AutoEP, `zerosafe.formats.deepspeed.moe`): a flat group of expert params
is partitioned over the expert-data-parallel group of one expert-parallel rank, not over all
ranks, and the rank files holding it may keep it at different group indices. A `FlatGroup`
names its partitions by `(rank, group index)` in partition order; a `GroupParam` says which
output tensor a param's elements go to, and where (`runs`, for AutoEP's fused expert weights,
of which each expert-parallel rank holds some experts).

Nothing here touches files: the functions take element counts and return `Piece`s, so they
can be checked against a brute-force simulation of the flat buffers (tests/formats/deepspeed/test_layout.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zerosafe.errors import LayoutMismatchError

__all__ = [
    "FlatGroup",
    "GroupParam",
    "Piece",
    "map_runs",
    "split_by_segments",
    "zero12_partition_pieces",
    "zero3_partition_numel",
    "zero3_pieces",
]


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of one parameter's elements that one rank holds contiguously."""

    param: int
    """Index of the parameter in the group (or, for ZeRO-3, in the rank's flat order)."""
    rank: int
    src_offset: int
    """Element offset of the run in that rank's flat partition."""
    numel: int
    dst_offset: int
    """Element offset of the run inside the parameter (row-major)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupParam:
    """One param of a flat group: how many elements it has there and where they go."""

    name: str
    """The output tensor its elements go to."""
    numel: int
    """Elements in the flat group (for an AutoEP expert weight: the local experts' only)."""
    runs: tuple[tuple[int, int, int], ...] = ()
    """`(offset in the param, offset in the output tensor, count)`, covering the param; empty
    when element i of the param is element i of the output tensor."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatGroup:
    """One flat group and where its partitions are saved."""

    label: str
    """Names the group in messages: `param group 1` or `param group 2 (ep_size_2, expert-parallel
    rank 1)`."""
    parts: tuple[tuple[int, int], ...]
    """`(rank, index of the group in that rank's optimizer file)`, in partition order."""
    params: tuple[GroupParam, ...]
    partition_numel: int = 0
    """ZeRO-1/2: elements per partition (`P`)."""
    alignment_paddings: tuple[int, ...] = ()
    """ZeRO-1/2: padding after each param."""


def map_runs(
    runs: Sequence[tuple[int, int, int]], offset: int, numel: int
) -> list[tuple[int, int, int]]:
    """Where elements `[offset, offset + numel)` of a param go in its output tensor.

    Args:
        runs: `GroupParam.runs`, sorted by offset in the param. Elements no run covers go
            nowhere: an AutoEP expert that two expert-parallel ranks hold is taken from the
            first one only.

    Returns:
        `(offset in the output tensor, offset from `offset`, count)` tuples in param order;
        `[(offset, 0, numel)]` when `runs` is empty (the identity).
    """
    if not runs:
        return [(offset, 0, numel)]
    out = []
    end = offset + numel
    for start, dst, count in runs:
        lo, hi = max(start, offset), min(start + count, end)
        if lo < hi:
            out.append((dst + lo - start, lo - offset, hi - lo))
    return out


def zero12_partition_pieces(
    numels: Sequence[int],
    alignment_paddings: Sequence[int],
    partition_numel: int,
    saved_numels: Sequence[int],
    *,
    where: str = "",
) -> list[Piece]:
    """Pieces of every param of one ZeRO-1/2 flat group.

    Args:
        numels: Element count of each param, in `param_shapes` order.
        alignment_paddings: Padding after each param (zeros when the checkpoint has none).
        partition_numel: Elements per rank partition (`P`; every rank but the last saves `P`).
        saved_numels: Elements each rank actually saved (index = rank).
        where: Names the group in error messages.

    Returns:
        Pieces ordered by param, then by destination offset.

    Raises:
        LayoutMismatchError: If the params do not fit the saved partitions.
    """
    world_size = len(saved_numels)
    if len(alignment_paddings) != len(numels):
        raise LayoutMismatchError(
            f"{where}: {len(alignment_paddings)} alignment paddings for {len(numels)} params"
        )
    if partition_numel <= 0 and sum(numels) > 0:
        raise LayoutMismatchError(f"{where}: partition of {partition_numel} elements")
    for rank, saved in enumerate(saved_numels):
        if saved > partition_numel:
            raise LayoutMismatchError(
                f"{where}: rank {rank} saved {saved} elements, more than rank 0's "
                f"{partition_numel}; partitions must be equal but for trailing padding"
            )
    total = sum(numels) + sum(alignment_paddings)
    capacity = partition_numel * world_size
    if total > capacity:
        raise LayoutMismatchError(
            f"{where}: params need {total} elements but {world_size} partitions of "
            f"{partition_numel} hold {capacity}; was the checkpoint saved with another "
            "world size, or are rank files from different runs mixed?"
        )
    pieces: list[Piece] = []
    offset = 0
    for index, numel in enumerate(numels):
        done = 0
        while done < numel:
            flat = offset + done
            rank = flat // partition_numel
            in_rank = flat - rank * partition_numel
            count = min(numel - done, partition_numel - in_rank)
            if in_rank + count > saved_numels[rank]:
                raise LayoutMismatchError(
                    f"{where}: param {index} needs elements [{in_rank}, {in_rank + count}) of "
                    f"rank {rank}'s partition, which saved only {saved_numels[rank]}"
                )
            pieces.append(Piece(index, rank, in_rank, count, done))
            done += count
        offset += numel + alignment_paddings[index]
    return pieces


def zero3_partition_numel(numel: int, world_size: int) -> int:
    """Elements of one param that each rank holds under ZeRO-3 (`ceil(numel / world_size)`)."""
    return -(-numel // world_size)


def zero3_pieces(numels: Sequence[int], world_size: int) -> tuple[list[Piece], int]:
    """Pieces of params partitioned ZeRO-3 style, consecutive in each rank's flat space.

    Args:
        numels: Element count of each param, in flat order.
        world_size: Data-parallel world size.

    Returns:
        The pieces (by param, then rank) and the number of elements each rank holds in all.
    """
    pieces: list[Piece] = []
    offset = 0
    for index, numel in enumerate(numels):
        per_rank = zero3_partition_numel(numel, world_size)
        for rank in range(world_size):
            start = rank * per_rank
            count = min(per_rank, numel - start)
            if count > 0:
                pieces.append(Piece(index, rank, offset, count, start))
        offset += per_rank
    return pieces, offset


def split_by_segments(
    offset: int, numel: int, segment_numels: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """Split a run of a rank's virtual flat space over the tensors that make it up.

    ZeRO-3 saves one rank's flat space as several sub-group tensors; a run that crosses a
    boundary is read from two of them.

    Returns:
        `(segment, offset_in_segment, numel, offset_in_run)` tuples covering the run.

    Raises:
        LayoutMismatchError: If the run goes past the last segment.
    """
    out = []
    seg_start = 0
    done = 0
    for segment, seg_numel in enumerate(segment_numels):
        seg_end = seg_start + seg_numel
        pos = offset + done
        if done < numel and seg_start <= pos < seg_end:
            count = min(numel - done, seg_end - pos)
            out.append((segment, pos - seg_start, count, done))
            done += count
        seg_start = seg_end
    if done < numel:
        raise LayoutMismatchError(
            f"elements [{offset}, {offset + numel}) run past the saved flat space of {seg_start}"
        )
    return out
