"""What every reader must survive as the DCP reader does (issue 39): a `zerosafe convert` killed
with SIGKILL midway and run again, a conversion from S3 into S3 on the loopback moto server,
and `verify --against` (passing, and failing on one flipped byte). The readers' test folders
call these with their own framework-made saves: a test module defines a `save` fixture (the
folder a user passes) and a `TestRobust(RobustChecks)` class with the conversion's `ARGS`."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.io.s3.support import (
    MotoServer,
    assert_same_output,
    download_folder,
    run_zerosafe,
    upload_folder,
)
from zerosafe_app.cli import main

_KILL_IN_MERGE = """
import os, signal, sys
from zerosafe.run import local
from zerosafe_app.cli import main

after = int(sys.argv[1])
merge_unit = local.merge_unit
started = []

def die(num_bytes):
    os.kill(os.getpid(), signal.SIGKILL)

def merge_then_die(*args, on_bytes=None, **kwargs):
    started.append(args)
    # the merge after `after` finished ones dies while copying its first bytes
    return merge_unit(*args, on_bytes=on_bytes if len(started) <= after else die, **kwargs)

local.merge_unit = merge_then_die
sys.exit(main(sys.argv[2:]))
"""


def convert_here(
    capsys: pytest.CaptureFixture[str], src: str, out: str, *args: str
) -> dict[str, Any]:
    """`zerosafe convert SRC OUT ARGS --via local --json` in this process: the summary."""
    code = main(["convert", src, out, "--via", "local", "--json", *args])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    return dict(json.loads(stdout))


def verify_here(capsys: pytest.CaptureFixture[str], out: str, *args: str) -> tuple[int, Any]:
    """`zerosafe verify OUT ARGS --json` in this process: the exit code and the report."""
    code = main(["verify", out, "--json", *args])
    stdout, _ = capsys.readouterr()
    return code, json.loads(stdout)


def _records(out: Path) -> dict[str, int]:
    """The unit records a run left in the work area, with their mtimes."""
    works = list((out / ".zerosafe-work").iterdir())
    assert len(works) == 1, works
    return {p.name: p.stat().st_mtime_ns for p in (works[0] / "units").glob("*.json")}


def kill_midway_then_resume(
    env: dict[str, str], src: Path, out: Path, reference: Path, *args: str
) -> None:
    """`zerosafe convert SRC OUT ARGS` (one unit at a time) SIGKILLed while it copies the
    bytes of a merge chosen at random, then the same command again: it completes, keeps every
    merge the killed run finished (the summary's counts), verifies every shard again (a verify
    is never kept from another run) and its output is byte-identical to `reference`, an
    uninterrupted run of the same command."""
    argv = ("convert", str(src), str(out), "--via", "local", "--json", "--parallel", "1", *args)
    num_shards = len(list(reference.glob("model-*.safetensors")))
    assert num_shards >= 3, "too few shards for a kill midway"
    after = random.randint(1, num_shards - 1)
    why = f"killed in merge {after + 1} of {num_shards}"
    killed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILL_IN_MERGE), str(after), *argv],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, f"{why}: {killed.stderr[-2000:]}"
    assert not (out / "zerosafe-complete.json").exists(), why
    # the kill landed while a shard was being written: its temporary file is left half-done
    assert len(list(out.rglob("*.partial"))) == 1, why
    before = _records(out)
    assert sorted(before) == [f"{stage}-{i:05d}.json" for stage in ("merge", "verify")
                              for i in range(after)], why  # fmt: skip

    summary = json.loads(run_zerosafe(env, *argv, "--keep-work").stdout)
    assert summary["status"] == "converted", why
    executed = summary["tasks_executed"]
    assert (executed["merge"], executed["verify"]) == (num_shards - after, num_shards), why
    kept = f"resumed: {after} merge unit(s) finished by an interrupted run"
    assert any(n.startswith(kept) for n in summary["notes"]), (why, summary["notes"])
    after_records = _records(out)
    merged = {k: t for k, t in before.items() if k.startswith("merge-")}
    assert {k: after_records[k] for k in merged} == merged, f"{why}: kept merges rewritten"
    assert not list(out.rglob("*.partial")), why
    assert_same_output(out, reference)


def s3_to_s3_equals_local(
    capsys: pytest.CaptureFixture[str],
    moto: MotoServer,
    bucket: str,
    src: Path,
    reference: Path,
    tmp_path: Path,
    *args: str,
) -> None:
    """The save uploaded to the moto server, converted from `s3://` into `s3://`: the output,
    downloaded, is byte-identical to `reference` (the local conversion with the same ARGS),
    `verify --against` passes on S3 and a second run finds nothing to do."""
    url = upload_folder(moto.url, src, bucket, f"save/{src.name}")
    out = f"s3://{bucket}/out"
    endpoint = ("--storage-option", f"endpoint_url={moto.url}")
    summary = convert_here(capsys, url, out, *endpoint, *args)
    assert summary["status"] == "converted" and summary["integrity"]["records_failed"] == []
    assert_same_output(download_folder(moto.url, out, tmp_path / "got"), reference)
    code, report = verify_here(capsys, out, "--against", url, *endpoint)
    assert code == 0, report["failures"]
    assert report["against"]["source_identity"] == "same contents"
    assert convert_here(capsys, url, out, *endpoint, *args)["status"] == "already-complete"


def verify_then_flip_a_byte(capsys: pytest.CaptureFixture[str], out: Path, src: Path) -> None:
    """`verify OUT --against SRC` passes on `out` (a fresh conversion of SRC), then fails with
    exit 1 once one byte of an output shard's data is flipped."""
    code, report = verify_here(capsys, str(out), "--against", str(src))
    assert code == 0, report["failures"]
    assert report["against"]["source_identity"] == "same contents"
    shard = sorted(out.glob("model*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + (len(data) - 8 - header) // 2] ^= 0x01  # lowest bit: the value stays finite
    shard.write_bytes(bytes(data))
    code, report = verify_here(capsys, str(out), "--against", str(src))
    assert code == 1, report
    failed = [(f["check"], f["file"]) for f in report["failures"]]
    assert any(c == "checksum" and shard.name in f for c, f in failed), failed


class RobustChecks:
    """The three checks on a module's `save` fixture, converted with `ARGS` (a subclass sets
    them). The module imports the moto fixtures (`moto`, `bucket` and what they use)."""

    ARGS: tuple[str, ...] = ()

    @pytest.fixture(scope="class")
    def reference(self, save: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """An uninterrupted local conversion of the save with `ARGS`."""
        out = tmp_path_factory.mktemp(f"{save.name}-reference") / "out"
        assert main(["convert", str(save), str(out), "--via", "local", "-q", *self.ARGS]) == 0
        return out

    def test_sigkill_midway_then_resume(
        self, save: Path, reference: Path, local_env: dict[str, str], tmp_path: Path
    ) -> None:
        kill_midway_then_resume(local_env, save, tmp_path / "out", reference, *self.ARGS)

    def test_s3_to_s3(
        self,
        save: Path,
        reference: Path,
        moto: MotoServer,
        bucket: str,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        s3_to_s3_equals_local(capsys, moto, bucket, save, reference, tmp_path, *self.ARGS)

    def test_verify_against_then_a_flipped_byte(
        self, save: Path, reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        out = Path(shutil.copytree(reference, tmp_path / "out"))
        verify_then_flip_a_byte(capsys, out, save)
