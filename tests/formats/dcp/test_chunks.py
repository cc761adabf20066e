"""DCP chunk math on plain integers, checked against numpy slicing of an index array."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerosafe.errors import LayoutMismatchError
from zerosafe.formats.dcp.chunks import ChunkBox, check_chunk_cover, chunk_runs


def _expected_elements(size: tuple[int, ...], box: ChunkBox) -> np.ndarray:
    index = np.arange(math.prod(size), dtype=np.int64).reshape(size)
    window = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))
    return index[window].reshape(-1)


def _run_elements(runs: object) -> np.ndarray:
    parts = [np.arange(dst, dst + n) for _, n, dst in runs]  # type: ignore[attr-defined]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def test_dim0_shard_is_one_run() -> None:
    runs = chunk_runs((101, 12), ChunkBox(offsets=(78, 0), sizes=(23, 12)))
    assert list(runs) == [(0, 23 * 12, 78 * 12)]


def test_dim1_shard_is_one_run_per_row() -> None:
    runs = chunk_runs((10, 33), ChunkBox(offsets=(0, 27), sizes=(10, 6)))
    assert list(runs) == [(6 * r, 6, r * 33 + 27) for r in range(10)]


def test_2d_mesh_block() -> None:
    runs = chunk_runs((7, 9), ChunkBox(offsets=(4, 5), sizes=(3, 4)))
    assert list(runs) == [(0, 4, 41), (4, 4, 50), (8, 4, 59)]


def test_3d_middle_dim_shard_coalesces_trailing_dim() -> None:
    runs = chunk_runs((3, 5, 6), ChunkBox(offsets=(0, 2, 0), sizes=(3, 2, 6)))
    assert list(runs) == [(0, 12, 12), (12, 12, 42), (24, 12, 72)]


def test_scalar_and_empty() -> None:
    assert list(chunk_runs((), ChunkBox(offsets=(), sizes=()))) == [(0, 1, 0)]
    assert list(chunk_runs((0, 4), ChunkBox(offsets=(0, 0), sizes=(0, 4)))) == []
    assert list(chunk_runs((3, 5, 6), ChunkBox(offsets=(0, 5, 0), sizes=(3, 0, 6)))) == []


def test_chunk_outside_tensor_is_refused() -> None:
    with pytest.raises(LayoutMismatchError, match=r"reaches element 12 of dimension 1"):
        chunk_runs((4, 10), ChunkBox(offsets=(0, 8), sizes=(4, 4)), where="'w'")
    with pytest.raises(LayoutMismatchError, match=r"expected 2 dimensions"):
        chunk_runs((4, 10), ChunkBox(offsets=(0,), sizes=(4,)))


def test_overlap_is_named() -> None:
    boxes = [ChunkBox(offsets=(0, 0), sizes=(6, 4)), ChunkBox(offsets=(5, 0), sizes=(5, 4))]
    with pytest.raises(LayoutMismatchError, match=r"'w': chunks overlap at element \[5, 0\]"):
        check_chunk_cover((10, 4), boxes, where="'w'")


def test_missing_elements_are_named() -> None:
    boxes = [ChunkBox(offsets=(0, 0), sizes=(4, 3)), ChunkBox(offsets=(0, 4), sizes=(4, 3))]
    with pytest.raises(LayoutMismatchError, match=r"hold 24 of the 28 .* element \[0, 3\]"):
        check_chunk_cover((4, 7), boxes, where="'v'")


def test_missing_tail() -> None:
    boxes = [ChunkBox(offsets=(0,), sizes=(5,))]
    with pytest.raises(LayoutMismatchError, match=r"element \[5\] is in no chunk"):
        check_chunk_cover((9,), boxes)


@st.composite
def _grid(draw: st.DrawFn) -> tuple[tuple[int, ...], list[ChunkBox]]:
    """A tensor cut on every dimension into uneven pieces, as nested Shard placements do."""
    ndim = draw(st.integers(0, 4))
    size = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    cuts = []
    for full in size:
        points = sorted(draw(st.lists(st.integers(0, full), max_size=3)))
        edges = [0, *points, full]
        cuts.append([(a, b - a) for a, b in zip(edges, edges[1:], strict=False)])
    boxes = [ChunkBox(offsets=(), sizes=())]
    for pieces in cuts:
        boxes = [
            ChunkBox(offsets=(*b.offsets, o), sizes=(*b.sizes, s)) for b in boxes for o, s in pieces
        ]
    perm = draw(st.permutations(range(len(boxes))))
    return size, [boxes[i] for i in perm]


@settings(max_examples=300, deadline=None)
@given(_grid())
def test_runs_match_numpy_slicing(case: tuple[tuple[int, ...], list[ChunkBox]]) -> None:
    size, boxes = case
    runs = check_chunk_cover(size, boxes)
    seen = []
    for box, r in zip(boxes, runs, strict=True):
        got = _run_elements(r)
        np.testing.assert_array_equal(got, _expected_elements(size, box))
        offsets = [c for c, _, _ in r]
        assert offsets == [i * r.run_numel for i in range(r.count)]
        seen.append(got)
    allv = np.sort(np.concatenate(seen)) if seen else np.zeros(0, np.int64)
    np.testing.assert_array_equal(allv, np.arange(math.prod(size)))


@settings(max_examples=200, deadline=None)
@given(_grid(), st.data())
def test_dropping_or_growing_a_chunk_is_caught(
    case: tuple[tuple[int, ...], list[ChunkBox]], data: st.DataObject
) -> None:
    size, boxes = case
    nonempty = [i for i, b in enumerate(boxes) if b.numel]
    if not nonempty:
        return
    i = data.draw(st.sampled_from(nonempty))
    with pytest.raises(LayoutMismatchError, match="in no chunk"):
        check_chunk_cover(size, boxes[:i] + boxes[i + 1 :])
    if len(nonempty) > 1:
        with pytest.raises(LayoutMismatchError, match="overlap"):
            check_chunk_cover(size, [*boxes, boxes[i]])
