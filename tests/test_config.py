"""`ConvertOptions` takes its fields' own names only (0.1.0 was the first release: no aliases)."""

from __future__ import annotations

import dataclasses

import pytest

from zerosafe.config import ConvertOptions


@pytest.mark.parametrize(
    "old", ["memory_bytes", "max_shard_bytes", "extract_part_bytes", "check_finite"]
)
def test_names_of_an_unreleased_version_are_refused(old: str) -> None:
    with pytest.raises(TypeError, match=old):
        ConvertOptions(**{old: 1})


def test_replace_validates_again() -> None:
    new = ConvertOptions(memory=2 * 10**9, max_shard_size=10**6, extract_part_size=2**21)
    assert dataclasses.replace(new, dtype="bf16").dtype == "bfloat16"
    assert dataclasses.replace(new, dtype="bf16").memory == 2 * 10**9
