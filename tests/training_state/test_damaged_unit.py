"""A kept unit damaged at its recorded size (issue 37, item 5), for `--to universal` and
`--to dcp`, on a real DeepSpeed checkpoint (a shared fixture, no training).

A run SIGKILLed midway leaves finished units recorded; then a block of one kept unit's file
is zeroed in place, size and mtime unchanged (a crash's zero-filled page, bit rot on NFS), so
the rerun keeps that unit. Its final re-read catches the damage, and before the fix every
later run kept the same unit and failed the same way, `--overwrite` included. Now the failing
run drops the unit (record and files) and says that running again redoes it; the next run
redoes only that unit, and the output is byte for byte a clean run's. `--overwrite` discards
the previous attempt's units and succeeds at once.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.training_state.conftest import shared_checkpoint
from zerosafe.errors import VerificationError
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import Storage
from zerosafe.training_state import convert_to_dcp, convert_to_universal
from zerosafe.training_state.dcp import _Slice

CKPT = "z3-fp32-ws4-tied-2groups-persist"
REPO = Path(__file__).resolve().parents[2]
KILLED_AFTER = 5
"""Param units (universal) or units (dcp) that finish before the kill."""

_KILL_AFTER = """
import os, signal, sys
from zerosafe.training_state import dcp, universal

to, ckpt, out, after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
module, name = (universal, "write_param") if to == "universal" else (dcp, "write_unit")
write = getattr(module._Job, name)
done = []

def write_then_die(self, *args):
    if len(done) == after:
        os.kill(os.getpid(), signal.SIGKILL)
    done.append(args)
    return write(self, *args)

setattr(module._Job, name, write_then_die)
convert = universal.convert_to_universal if to == "universal" else dcp.convert_to_dcp
convert(ckpt, out, unit_bytes=1, parallel=1)  # one unit at a time: the kill lands in one
"""


def _convert(to: str, out: Path, **kw: Any) -> Any:
    convert = convert_to_universal if to == "universal" else convert_to_dcp
    return convert(str(shared_checkpoint(CKPT)), str(out), unit_bytes=1, **kw)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An uninterrupted run of each target, the same units as the killed ones."""
    tmp = tmp_path_factory.mktemp("clean")
    return {to: tmp / to for to in ("universal", "dcp") if _convert(to, tmp / to)}


def _kill_midway(to: str, out: Path) -> Path:
    """Run until `KILLED_AFTER` units are written, SIGKILL; returns the units folder."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILL_AFTER), to,
         str(shared_checkpoint(CKPT)), str(out), str(KILLED_AFTER)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    return next((out / ".zerosafe-work").iterdir()) / "units"


def _zero_a_kept_block(to: str, out: Path, units: Path) -> tuple[Path, Path]:
    """Zero the start of a tensor's data in a kept unit's file, keeping its size and mtime;
    returns the unit's record and the file."""
    if to == "universal":  # unit 2: the first param's states
        record = units / "universal-00002.json"
        rel = next(f["path"] for f in json.loads(record.read_text())["result"]["files"]
                   if f["path"].endswith("/fp32.pt"))  # fmt: skip
        path = out / rel
        zf = TorchZipFile(Storage().open_source(str(path)))
        start, size = zf.data_offset(zf.storage_record("0")), zf.storage_record("0").size_bytes
    else:
        record = units / "dcp-00000.json"
        (written,) = json.loads(record.read_text())["result"]["files"]
        entry = next(e for e in written["items"] if e["crc32"] is not None)
        path = out / written["path"]
        item = _Slice(Storage().open_source(str(path)), entry["offset"], entry["length"])
        zf = TorchZipFile(item)
        rec = zf.storage_record("0")
        start, size = entry["offset"] + zf.data_offset(rec), rec.size_bytes
    stat = path.stat()
    raw = bytearray(path.read_bytes())
    block = min(size, 4096)
    assert any(raw[start : start + block]), "the block must hold data to damage"
    raw[start : start + block] = bytes(block)
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    return record, path


def _assert_same_output(to: str, out: Path, reference: Path) -> None:
    pattern = "*.pt" if to == "universal" else "*.distcp"
    files = sorted(str(p.relative_to(reference)) for p in reference.rglob(pattern))
    assert files and files == sorted(str(p.relative_to(out)) for p in out.rglob(pattern))
    for rel in files:
        assert (out / rel).read_bytes() == (reference / rel).read_bytes(), rel
    if to == "universal":
        assert (out / "latest_universal").read_bytes() == (
            reference / "latest_universal"
        ).read_bytes()
    else:
        ours = pickle.loads((out / ".metadata").read_bytes())
        theirs = pickle.loads((reference / ".metadata").read_bytes())
        assert ours.storage_data == theirs.storage_data
        assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert not (out / ".zerosafe-work").exists() and not list(out.rglob("*.partial"))


@pytest.mark.parametrize("to", ["universal", "dcp"])
def test_a_damaged_kept_unit_is_dropped_and_redone(
    to: str, clean: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    units = _kill_midway(to, out)
    kept = len(list(units.glob("*.json")))
    record, damaged = _zero_a_kept_block(to, out, units)

    with pytest.raises(VerificationError) as failed:
        _convert(to, out)
    message = str(failed.value)
    assert "\n" not in message and str(damaged) in message, message
    assert "dropped" in message and "run the command again" in message, message
    assert not record.exists() and not damaged.exists()
    assert not (out / "zerosafe-universal-complete.json").exists()
    assert not (out / "zerosafe-dcp-complete.json").exists()

    recorded = len(list(units.glob("*.json")))  # the failing run finished the other units
    assert recorded > kept - 1
    summary = _convert(to, out)  # redoes only the dropped unit
    assert (summary.status, summary.units_run, summary.units_kept) == ("converted", 1, recorded)
    _assert_same_output(to, out, clean[to])


@pytest.mark.parametrize("to", ["universal", "dcp"])
def test_overwrite_after_the_damage_starts_clean(
    to: str, clean: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    units = _kill_midway(to, out)
    _zero_a_kept_block(to, out, units)
    summary = _convert(to, out, overwrite=True)
    assert summary.status == "converted" and summary.units_kept == 0, summary
    _assert_same_output(to, out, clean[to])
