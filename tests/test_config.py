"""`ConvertOptions` takes its fields' names from before 0.2 for one release."""

from __future__ import annotations

import dataclasses

from zerosafe.config import ConvertOptions


def test_old_option_names_are_aliases_of_the_new_ones() -> None:
    old = ConvertOptions(
        memory_bytes=2 * 10**9, max_shard_bytes=10**6, extract_part_bytes=2**21, check_finite=False
    )
    new = ConvertOptions(
        memory=2 * 10**9, max_shard_size=10**6, extract_part_size=2**21, allow_nonfinite=True
    )
    assert old == new and old.as_dict() == new.as_dict()
    assert ConvertOptions(check_finite=True).allow_nonfinite is False
    assert "memory_bytes" not in ConvertOptions().as_dict()  # aliases are not stored
    assert dataclasses.replace(new, dtype="bf16").memory == 2 * 10**9
