"""The ZeRO layout math against a brute-force simulation of DeepSpeed's flat buffers.

Each element of each param gets a unique id (param * 10**6 + index); the simulation builds
the flat partitions exactly as DeepSpeed lays them out, and the pieces must read every id
back from where it landed.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerosafe.errors import LayoutMismatchError
from zerosafe.formats.deepspeed.layout import (
    map_runs,
    split_by_segments,
    zero3_partition_numel,
    zero3_pieces,
    zero12_partition_pieces,
)
from zerosafe.formats.deepspeed.moe import expert_group_ranks

PAD = -1


def _ids(param: int, numel: int) -> np.ndarray:
    return param * 10**6 + np.arange(numel, dtype=np.int64)


def _simulate_zero12(numels, paddings, world_size, saved_trimmed):
    """Flat buffer of ids in order, each param followed by its padding, tail padded to a
    multiple of 2 * world_size, cut into equal partitions; trailing padding optionally not
    saved (ZeRO's optimizer) or saved (BF16_Optimizer)."""
    parts = []
    for i, (n, pad) in enumerate(zip(numels, paddings, strict=True)):
        parts.append(_ids(i, n))
        parts.append(np.full(pad, PAD, dtype=np.int64))
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    align = 2 * world_size
    total = -(-max(len(flat), 1) // align) * align
    flat = np.concatenate([flat, np.full(total - len(flat), PAD, dtype=np.int64)])
    partition = total // world_size
    ranks = [flat[r * partition : (r + 1) * partition] for r in range(world_size)]
    real_end = len(np.concatenate(parts)) if parts else 0
    if saved_trimmed:  # the last partitions do not store padding past the real data
        ranks = [
            rk[: max(0, min(partition, real_end - r * partition))] for r, rk in enumerate(ranks)
        ]
    return partition, ranks


def _reconstruct(pieces, numels, ranks):
    out = [np.full(n, -2, dtype=np.int64) for n in numels]
    for p in pieces:
        out[p.param][p.dst_offset : p.dst_offset + p.numel] = ranks[p.rank][
            p.src_offset : p.src_offset + p.numel
        ]
    return out


@settings(max_examples=300, deadline=None)
@given(
    numels=st.lists(st.integers(0, 70), min_size=1, max_size=9),
    world_size=st.integers(1, 8),
    pad_seed=st.integers(0, 3),
    trimmed=st.booleans(),
)
def test_zero12_pieces_match_simulation(numels, world_size, pad_seed, trimmed):
    paddings = [(pad_seed * (i + 1)) % 3 if i < len(numels) - 1 else 0 for i in range(len(numels))]
    partition, ranks = _simulate_zero12(numels, paddings, world_size, trimmed)
    pieces = zero12_partition_pieces(numels, paddings, partition, [len(r) for r in ranks])
    got = _reconstruct(pieces, numels, ranks)
    for i, n in enumerate(numels):
        np.testing.assert_array_equal(got[i], _ids(i, n))
    # pieces never overlap and never touch padding
    for p in pieces:
        assert (ranks[p.rank][p.src_offset : p.src_offset + p.numel] != PAD).all()


def test_zero12_refuses_partitions_too_small():
    with pytest.raises(LayoutMismatchError, match="another world size"):
        zero12_partition_pieces([10, 10], [0, 0], 4, [4, 4])


def test_zero12_refuses_params_in_unsaved_tail():
    # 2 ranks x 6 = 12 slots, params need 11, but the last rank saved only 3 of 6
    with pytest.raises(LayoutMismatchError, match="saved only 3"):
        zero12_partition_pieces([11], [0], 6, [6, 3])


def _simulate_zero3(numels, world_size):
    per_rank = [[] for _ in range(world_size)]
    for i, n in enumerate(numels):
        c = zero3_partition_numel(n, world_size)
        padded = np.concatenate([_ids(i, n), np.full(c * world_size - n, PAD, dtype=np.int64)])
        for r in range(world_size):
            per_rank[r].append(padded[r * c : (r + 1) * c])
    return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in per_rank]


@settings(max_examples=300, deadline=None)
@given(
    numels=st.lists(st.integers(0, 60), min_size=1, max_size=8),
    world_size=st.integers(1, 8),
    cuts=st.lists(st.integers(0, 200), max_size=4),
)
def test_zero3_pieces_match_simulation_with_subgroups(numels, world_size, cuts):
    ranks = _simulate_zero3(numels, world_size)
    pieces, per_rank = zero3_pieces(numels, world_size)
    assert all(len(r) == per_rank for r in ranks)
    # sub-groups: each rank's flat space saved as several tensors cut at the same points
    bounds = sorted({min(c, per_rank) for c in cuts} | {0, per_rank})
    segments = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    seg_arrays = [[r[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] for r in ranks]
    out = [np.full(n, -2, dtype=np.int64) for n in numels]
    for p in pieces:
        for seg, off, count, run in split_by_segments(p.src_offset, p.numel, segments):
            out[p.param][p.dst_offset + run : p.dst_offset + run + count] = seg_arrays[p.rank][seg][
                off : off + count
            ]
    for i, n in enumerate(numels):
        np.testing.assert_array_equal(out[i], _ids(i, n))


def test_split_by_segments_refuses_overrun():
    with pytest.raises(LayoutMismatchError):
        split_by_segments(5, 10, [4, 4])


@pytest.mark.parametrize(
    ("numel", "world_size", "want"), [(0, 3, 0), (1, 3, 1), (9, 3, 3), (10, 3, 4), (4848, 2, 2424)]
)
def test_zero3_partition_numel(numel, world_size, want):
    assert zero3_partition_numel(numel, world_size) == want


# MoE: AutoEP fused expert weights land at the rows their placement names; native experts are
# renamed, their elements stay where they are.


@settings(max_examples=60, deadline=None)
@given(
    num_local=st.integers(1, 4),
    per=st.integers(1, 7),
    num_experts=st.integers(4, 9),
    seed=st.integers(0, 10**6),
    cuts=st.lists(st.integers(0, 60), max_size=4),
)
def test_map_runs_places_experts(num_local, per, num_experts, seed, cuts):
    """A rank's local `[L, ...]` tensor, read in arbitrary runs (partition boundaries), lands
    at the logical rows of its experts, element for element."""
    experts = np.random.default_rng(seed).permutation(num_experts)[:num_local].tolist()
    runs = tuple((i * per, x * per, per) for i, x in enumerate(experts))
    local = np.arange(num_local * per)
    logical = np.full(num_experts * per, -1)
    bounds = sorted({0, num_local * per, *(c % (num_local * per + 1) for c in cuts)})
    for start, end in zip(bounds, bounds[1:], strict=False):
        for dst, delta, count in map_runs(runs, start, end - start):
            assert np.all(logical[dst : dst + count] == -1), "written twice"
            logical[dst : dst + count] = local[start + delta : start + delta + count]
    for i, x in enumerate(experts):
        assert logical[x * per : (x + 1) * per].tolist() == local[i * per : (i + 1) * per].tolist()
    assert (logical >= 0).sum() == num_local * per


def test_map_runs_identity_and_replicas():
    assert map_runs((), 5, 3) == [(5, 0, 3)]
    # an expert held by two ranks is taken from one: the other's run is left out
    assert map_runs(((0, 8, 4),), 0, 8) == [(8, 0, 4)]


@pytest.mark.parametrize(
    ("world_size", "ep_size", "data_before", "want"),
    [
        # DeepSpeed's own example (utils/groups.py): world 16, expert-parallel size 2
        (16, 2, False, ((0, 2, 4, 6, 8, 10, 12, 14), (1, 3, 5, 7, 9, 11, 13, 15))),
        (4, 2, True, ((0, 1), (2, 3))),
        (4, 4, False, ((0,), (1,), (2,), (3,))),
        (4, 1, True, ((0, 1, 2, 3),)),
        (6, 3, True, ((0, 1), (2, 3), (4, 5))),
    ],
)
def test_expert_group_ranks(world_size, ep_size, data_before, want):
    assert expert_group_ranks(world_size, ep_size, data_before_expert=data_before) == want
