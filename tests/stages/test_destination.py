"""Where an output may go, and one kind of output per folder (issue 37, items 4 and 6).

Item 4: `--to dcp` and `--to universal` into the checkpoint folder, or into its tag folder,
exited 0 with their files and marker among DeepSpeed's, and weights into the tag folder did
too. Item 6: `--to dcp`, then weights, then `--to universal` into one folder each exited 0,
and `inspect`/`verify` saw only one of the three. Each test failed before the fix. The
shipped sample checkpoint, converted by the command in this process.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import ConfigError, OutputExistsError
from zerosafe.io.storage import Storage
from zerosafe.pipeline import hold_destination, plan_job
from zerosafe.stages.destination import OUTPUT_KINDS, check_output_apart
from zerosafe.training_state import convert_to_universal
from zerosafe.training_state.dcp import convert_to_dcp
from zerosafe_app.cli import main

TAG = "global_step2"
TARGETS = {
    "dcp": ["--to", "dcp"],
    "universal": ["--to", "universal"],
    "weights": [],
    "adapter": ["--adapter"],
}


def _listing(folder: Path) -> dict[str, str]:
    """Every file under `folder` with its SHA-256, and every folder: the bytes, byte for byte."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            found[os.path.relpath(os.path.join(root, d), folder) + "/"] = ""
        for f in files:
            path = Path(root, f)
            found[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("inside", ["checkpoint", "tag folder", "source inside output"])
def test_output_in_the_checkpoint_is_refused(
    sample_ckpt: Path, target: str, inside: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused with exit 2 before anything is written: the checkpoint stays byte-equal."""
    source, output = {
        "checkpoint": (sample_ckpt, sample_ckpt),
        "tag folder": (sample_ckpt, sample_ckpt / TAG),
        "source inside output": (sample_ckpt / TAG, sample_ckpt),
    }[inside]
    before = _listing(sample_ckpt)
    args = ["convert", str(source), str(output), *TARGETS[target], "--via", "local", "-q"]
    assert main(args) == 2
    err = _one_line_error(capsys)
    assert "expected an output folder apart from the checkpoint" in err, err
    assert _listing(sample_ckpt) == before


def test_library_entry_points_refuse_too(sample_ckpt: Path) -> None:
    """Each target's own entry point checks, not only the command: the in-process driver
    (weights and adapters), the lease the flow takes first, `--to universal` and `--to dcp`."""
    before = _listing(sample_ckpt)
    inside = str(sample_ckpt / TAG)
    with pytest.raises(ConfigError, match="inside the checkpoint folder"):
        with hold_destination(Storage(), str(sample_ckpt), inside):
            pass
    with pytest.raises(ConfigError, match="inside the checkpoint folder"):
        convert_checkpoint(str(sample_ckpt), inside, ConvertOptions())
    with pytest.raises(ConfigError, match="inside the checkpoint folder"):
        convert_to_universal(str(sample_ckpt), inside)
    with pytest.raises(ConfigError, match="the checkpoint folder itself"):
        convert_to_dcp(str(sample_ckpt), str(sample_ckpt) + "/./")
    assert _listing(sample_ckpt) == before


def test_spellings_of_one_location(tmp_path: Path) -> None:
    """Links resolved for local paths; URLs normalised as their filesystem names them."""
    storage = Storage()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="the checkpoint folder itself"):
        check_output_apart(storage, str(tmp_path / "ckpt"), f"file://{tmp_path}/link/")
    with pytest.raises(ConfigError, match="inside the checkpoint folder"):
        check_output_apart(storage, str(tmp_path / "ckpt"), str(tmp_path / "link" / "out"))
    with pytest.raises(ConfigError, match="inside the checkpoint folder"):
        check_output_apart(storage, "s3://bucket/ckpt", "s3a://bucket//ckpt/global_step2/")
    with pytest.raises(ConfigError, match="a folder holding the checkpoint"):
        check_output_apart(storage, "memory://r/ckpt/global_step2", "memory://r/ckpt/")
    check_output_apart(storage, str(tmp_path / "ckpt"), str(tmp_path / "ckpt-out"))
    check_output_apart(storage, "s3://bucket/ckpt", "s3://bucket/ckpt2")


def _kinds_in(out: Path) -> set[str]:
    return {k.name for k in OUTPUT_KINDS if (out / k.marker_name).exists()}


def test_outputs_of_different_kinds_do_not_pile_up(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--to dcp`, then weights, then `--to universal` into one folder: the second and third
    are refused naming the marker found; with `--overwrite` each replaces the one before,
    so exactly one kind remains and `verify` checks it. A file no marker vouches for stays."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    ckpt = str(sample_ckpt)

    def convert(*extra: str) -> int:
        return main(["convert", ckpt, str(out), "--via", "local", "-q", *extra])

    assert convert("--to", "dcp") == 0
    assert _kinds_in(out) == {"dcp"}
    capsys.readouterr()
    for extra in ([], ["--to", "universal"]):
        assert convert(*extra) == 2
        err = _one_line_error(capsys)
        assert f"{out}/zerosafe-dcp-complete.json" in err and "--to dcp" in err, err
        assert "--overwrite" in err, err
        assert _kinds_in(out) == {"dcp"}
    with pytest.raises(OutputExistsError, match="zerosafe-dcp-complete.json"):
        plan_job(Storage(), ckpt, str(out), ConvertOptions())  # the lifecycle, as the flow runs it
    dcp_files = {".metadata", "__0_0.distcp"}
    assert dcp_files <= set(os.listdir(out))

    assert convert("--overwrite") == 0
    assert _kinds_in(out) == {"weights"}
    assert not dcp_files & set(os.listdir(out))
    assert main(["verify", str(out)]) == 0

    capsys.readouterr()
    assert convert("--to", "universal") == 2
    assert "zerosafe-complete.json" in _one_line_error(capsys)
    assert convert("--to", "universal", "--overwrite") == 0
    assert _kinds_in(out) == {"universal"}
    assert sorted(os.listdir(out)) == [
        f"{TAG}_universal", "latest_universal", "notes.txt", "zerosafe-universal-complete.json"
    ]  # fmt: skip
    assert main(["verify", str(out)]) == 0

    assert convert("--to", "dcp", "--overwrite") == 0
    assert _kinds_in(out) == {"dcp"}
    assert set(os.listdir(out)) == {*dcp_files, "notes.txt", "zerosafe-dcp-complete.json"}
    assert (out / "notes.txt").read_text() == "mine"
