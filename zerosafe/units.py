"""Byte sizes as users write them (`5GB`, `64MiB`) and as we print them."""

from __future__ import annotations

import re

__all__ = ["MAX_SIZE_BYTES", "format_bytes", "parse_size"]

_DECIMAL = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
_BINARY = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}
_SIZE_RE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([A-Za-z]*)\s*$")
MAX_SIZE_BYTES = 2**63 - 1
"""The largest size accepted: what a signed 64-bit count holds (9.22 EB)."""


def parse_size(value: str | int) -> int:
    """Parse a byte size: `20KB`, `64MB`, `5GB` are decimal, `64MiB` binary, a bare int is bytes.

    Args:
        value: The size as text or as an int.

    Returns:
        The size in bytes.

    Raises:
        ValueError: If the text is not a size.
    """
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        size = value
    else:
        match = _SIZE_RE.match(value)
        if not match:
            raise ValueError(f"'{value}' is not a size; write it like '5GB', '64MB' or '64MiB'")
        whole, fraction, unit = match.groups()
        unit_upper = unit.upper()
        factor = _BINARY.get(unit_upper) or _DECIMAL.get(unit_upper)
        if factor is None:
            raise ValueError(
                f"unit '{unit}' in '{value}' is not supported; use B, KB, MB, GB, TB (decimal) "
                "or KiB, MiB, GiB, TiB (binary)"
            )
        # Exact integer arithmetic: a float would turn 99999999999999999999PB into 1e35-ish.
        fraction = fraction or ""
        size = (int(whole + fraction) * factor) // 10 ** len(fraction)
    if size > MAX_SIZE_BYTES:
        raise ValueError(
            f"'{value}' is {size} bytes, more than the largest size accepted "
            f"({MAX_SIZE_BYTES} bytes, 9.22 EB)"
        )
    return size


def format_bytes(num_bytes: float) -> str:
    """Format a byte count for people, in decimal units (`1.23 GB`)."""
    size = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")
