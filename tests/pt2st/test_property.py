"""Property tests: random nested structures of containers, leaves and tensors (views of shared
storages among them) survive torch.save -> pt2st -> load_pt_like exactly."""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.pt2st.helpers import assert_same, roundtrip

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int8, torch.uint8, torch.uint16, torch.bool,
    torch.complex64,
]  # fmt: skip
BASE_NUMEL = 48

tensor_specs = st.tuples(
    st.just("T"),
    st.sampled_from(range(len(DTYPES))),
    st.sampled_from(["whole", "slice", "transposed", "strided", "fresh", "param"]),
    st.integers(0, 2),  # which base storage (per dtype): equal numbers share
    st.lists(st.integers(0, 3), max_size=3),  # shape of slices and fresh tensors
    st.integers(0, 10),  # offset
)
plain_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.complex_numbers(allow_nan=True, allow_infinity=True)
)
leaves = plain_leaves | tensor_specs  # half the leaves are tensors
keys = st.text(max_size=5) | st.integers(-3, 3)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(lambda v: ("TUPLE", v))
        | st.dictionaries(keys, children, max_size=4)
        | st.dictionaries(keys, children, max_size=4).map(collections.OrderedDict)
        | st.lists(st.integers(0, 9), max_size=3).map(lambda v: ("SIZE", v))
    )


structures = st.recursive(leaves, _containers, max_leaves=16)


def _bytes_tensor(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)  # every bit pattern: NaNs, infinities, subnormals, -0.0


def _build(spec: Any, bases: dict[tuple[int, int], torch.Tensor], gen: torch.Generator) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == "T":
        _, d, kind, base_id, shape, offset = spec
        dtype = DTYPES[d]
        base = bases.get((d, base_id))
        if base is None:
            base = bases[(d, base_id)] = _bytes_tensor(BASE_NUMEL, dtype, gen)
        numel = 1
        for s in shape:
            numel *= s
        if kind == "whole":
            return base
        if kind == "slice":
            return base[offset : offset + numel].view(shape)
        if kind == "transposed":
            return base[offset : offset + 12].view(3, 4).t()
        if kind == "strided":
            return base[offset :: 1 + offset % 3]
        if kind == "param":
            return torch.nn.Parameter(base[offset : offset + numel].view(shape), False)
        return _bytes_tensor(numel, dtype, gen).view(shape)
    if isinstance(spec, tuple) and spec and spec[0] == "TUPLE":
        return tuple(_build(v, bases, gen) for v in spec[1])
    if isinstance(spec, tuple) and spec and spec[0] == "SIZE":
        return torch.Size(spec[1])
    if isinstance(spec, list):
        return [_build(v, bases, gen) for v in spec]
    if isinstance(spec, dict):
        return type(spec)((k, _build(v, bases, gen)) for k, v in spec.items())
    return spec


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=structures,
    views=st.lists(tensor_specs, min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_structures_roundtrip(spec: Any, views: list[Any], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    bases: dict[tuple[int, int], torch.Tensor] = {}
    # Tensors in the tree and in `views` draw on the same few storages: sharing across the
    # structure, as tied weights and optimizer states have it.
    obj = {"tree": _build(spec, bases, gen), "views": [_build(v, bases, gen) for v in views]}
    with tempfile.TemporaryDirectory() as tmp:
        got, want, _ = roundtrip(obj, Path(tmp))
    assert_same(got, want)


@pytest.mark.parametrize("mutation", ["clone", "stride", "float_bits", "key_type", "tuple"])
def test_the_comparison_catches_differences(mutation: str) -> None:
    """The oracle itself: each kind of difference the round trip must not make is caught."""
    base = torch.arange(12.0)
    want = {"a": base[:6].view(2, 3), "b": base, 1: (0.0,)}
    got = {"a": base[:6].view(2, 3), "b": base, 1: (0.0,)}
    if mutation == "clone":
        got["b"] = base.clone()
    elif mutation == "stride":
        got["a"] = base[:6].view(3, 2).t().contiguous().t().t()
    elif mutation == "float_bits":
        got[1] = (-0.0,)
    elif mutation == "key_type":
        got = {"a": got["a"], "b": got["b"], "1": got[1]}
    else:
        got[1] = [0.0]
    with pytest.raises(AssertionError):
        assert_same(got, want)
