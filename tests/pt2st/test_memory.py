"""Bounded memory: converting a file six times the budget stays within the budget, and loading
the output on the CPU maps it instead of reading it (each run in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PROBE = Path(__file__).with_name("memory_probe.py")
MIB = 2**20
BUDGET = 40 * MIB  # the smallest budget a copy task accepts (1 MiB chunks)


def _probe(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # three fresh processes that import torch: 8 to 20 s
def test_convert_and_load_memory_is_bounded(tmp_path: Path) -> None:
    pt, out = tmp_path / "big.pt", tmp_path / "big.safetensors"
    _probe("make", str(pt), str(6 * BUDGET))
    converted = _probe("convert", str(pt), str(out), str(BUDGET))
    print("convert:", converted)
    assert converted["file_bytes"] > 6 * BUDGET - MIB
    # One 160 MiB tensor and an 80 MiB storage viewed twice went through 1 MiB chunks.
    assert converted["peak_above_baseline"] < BUDGET
    loaded = _probe("load", str(out))
    print("load:", loaded)
    assert loaded["values"] == [1.0, 2.0, 2.0]
    assert loaded["load_above_baseline"] < 8 * MIB  # mapped, not read
    assert loaded["touch_above_baseline"] < 8 * MIB  # one element reads a page, not a tensor
