"""CRC32 combination and the ledger that checks records read in pieces."""

from __future__ import annotations

import os
import random
import zlib

from hypothesis import given
from hypothesis import strategies as st

from zerosafe.formats.crc import CrcLedger, crc32_combine, crc32_zeros


@given(st.binary(max_size=300), st.binary(max_size=3000))
def test_combine_equals_crc_of_concatenation(a: bytes, b: bytes) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc_of_zeros_matches_zlib() -> None:
    for n in (0, 1, 3, 64, 4097, 1 << 20):
        assert crc32_zeros(n) == zlib.crc32(bytes(n))
        assert crc32_zeros(n, 0xDEADBEEF) == zlib.crc32(bytes(n), 0xDEADBEEF)


def test_combine_past_4_gib_matches_zlib() -> None:
    # Lengths over 2**32 exercise the high powers of x; zlib computes the reference by streaming.
    block = bytes(64 << 20)
    total = (1 << 32) + (3 << 20)
    crc_zeros = 0
    for _ in range(64):
        crc_zeros = zlib.crc32(block, crc_zeros)
    crc_zeros = zlib.crc32(bytes(3 << 20), crc_zeros)
    assert crc32_zeros(total) == crc_zeros
    head = b"ZeRO"
    combined = crc32_combine(zlib.crc32(head), crc_zeros, total)
    streamed = zlib.crc32(head)
    for _ in range(64):
        streamed = zlib.crc32(block, streamed)
    streamed = zlib.crc32(bytes(3 << 20), streamed)
    assert combined == streamed


def _ledger_for(data: bytes, cuts: list[int], skip: tuple[int, int] | None = None) -> CrcLedger:
    ledger = CrcLedger()
    bounds = sorted(set([0, len(data), *cuts]))
    pieces = list(zip(bounds, bounds[1:], strict=False))
    random.Random(1).shuffle(pieces)
    for a, b in pieces:
        if skip and (a, b) == skip:
            continue
        ledger.add("rec", a, b - a, zlib.crc32(data[a:b]))
    return ledger


def test_ledger_checks_pieces_in_any_order() -> None:
    data = os.urandom(10_000)
    result = _ledger_for(data, [100, 2500, 7000]).check({"rec": (len(data), zlib.crc32(data))})
    assert result.checked == ["rec"] and not result.failed and not result.skipped


def test_ledger_fills_small_gaps_by_reading() -> None:
    data = os.urandom(10_000)
    ledger = _ledger_for(data, [100, 104, 7000], skip=(100, 104))
    reads = []

    def read_gap(key, offset, length):
        reads.append((offset, length))
        return data[offset : offset + length]

    result = ledger.check({"rec": (len(data), zlib.crc32(data))}, read_gap)
    assert result.checked == ["rec"] and reads == [(100, 4)]


def test_ledger_skips_records_mostly_unread() -> None:
    data = os.urandom(10_000_000)
    ledger = CrcLedger()
    ledger.add("rec", 0, 1000, zlib.crc32(data[:1000]))
    result = ledger.check({"rec": (len(data), zlib.crc32(data))}, lambda *a: b"")
    assert result.skipped and not result.checked and not result.failed


def test_ledger_catches_a_flipped_byte() -> None:
    data = bytearray(os.urandom(5000))
    want = zlib.crc32(bytes(data))
    data[1234] ^= 1
    result = _ledger_for(bytes(data), [1000, 3000]).check({"rec": (len(data), want)})
    assert result.failed and result.failed[0][0] == "rec"


def test_ledger_round_trips_through_json() -> None:
    data = os.urandom(3000)
    ledger = _ledger_for(data, [10, 20])
    again = CrcLedger.from_json(ledger.to_json())
    assert again.check({"rec": (len(data), zlib.crc32(data))}).checked == ["rec"]
