from __future__ import annotations

import pytest

from zerosafe.units import format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("20KB", 20_000),
        ("64MB", 64_000_000),
        ("5GB", 5_000_000_000),
        ("64MiB", 64 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("123", 123),
        ("2 gib", 2 * 2**30),
        (77, 77),
    ],
)
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "GB", "5XB", "-1GB", "1e9"])
def test_parse_size_refuses(bad):
    with pytest.raises(ValueError, match="size|unit"):
        parse_size(bad)


def test_format_bytes():
    assert format_bytes(999) == "999 B"
    assert format_bytes(1_234_000) == "1.23 MB"


def test_parse_size_is_exact_and_bounded():
    # Exact integer arithmetic: through a float this was 123456789012345680 bytes.
    assert parse_size("123456789012345678B") == 123456789012345678
    assert parse_size("1.000000001GB") == 1_000_000_001
    assert parse_size(str(2**63 - 1)) == 2**63 - 1
    for absurd in (str(2**63), "99999999999999999999PB", 2**63):
        with pytest.raises(ValueError, match="largest size"):
            parse_size(absurd)
