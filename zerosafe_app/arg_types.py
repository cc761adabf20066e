"""Argparse `type=` parsers of the commands' flags: a bad value is a usage error (exit 2) that
says why. The engine's own parsers (`zerosafe.units.parse_size`) raise plain `ValueError`s."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from zerosafe.units import parse_size

__all__ = ["int_at_least", "list_of", "positive_size", "seconds", "size_argument"]


def size_argument(text: str) -> int:
    """`parse_size` as an argparse `type=`."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A whole number of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} (got {value})")
        return value

    return parse


def positive_size(text: str) -> int:
    """A size of more than 0 bytes."""
    value = size_argument(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes (got '{text}')")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds") from None
    if not 0 <= value < math.inf:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (got '{text}')")
    return value


def list_of(parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A comma-separated list of what `parse` reads."""

    def parse_list(text: str) -> list[Any]:
        return [parse(item) for item in text.split(",")]

    return parse_list
