"""Damaged or unusual DCP checkpoints are refused with a message that names the file, what was
expected, what was found and the fix. The damage is done to real torch-written checkpoints."""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_refused_in_one_line, zerosafe_child
from zerosafe.errors import (
    CheckpointFormatError,
    LayoutMismatchError,
    UnsafePickleError,
    UnsupportedCheckpointError,
)
from zerosafe.formats.dcp.reader import read_dcp_layout
from zerosafe.io.storage import Storage

Checkpoint = Callable[[str], Path]


@pytest.fixture
def flat(dcp_checkpoint: Checkpoint, tmp_path: Path) -> Path:
    """A writable copy of the 2-rank `flat` checkpoint (w: Shard(0), v: Shard(1), b)."""
    return Path(shutil.copytree(dcp_checkpoint("flat"), tmp_path / "flat"))


def _edit_metadata(path: Path, edit: Callable[[Any], None]) -> None:
    # Tests may unpickle with torch's classes: they generate and damage fixtures.
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f)
    edit(meta)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def _storage_of(meta: Any, fqn: str, offsets: tuple[int, ...]) -> Any:
    return next(k for k in meta.storage_data if k.fqn == fqn and tuple(k.offset) == offsets)


def test_missing_distcp_file(flat: Path) -> None:
    os.remove(flat / "__1_0.distcp")
    with pytest.raises(
        CheckpointFormatError,
        match=r"__1_0.distcp: .*named in '.metadata' but missing.*Copy the whole folder",
    ):
        read_dcp_layout(str(flat), Storage())


def test_missing_metadata(flat: Path, tmp_path: Path) -> None:
    os.remove(flat / ".metadata")
    with pytest.raises(
        CheckpointFormatError, match=r"2 .distcp file\(s\) but no '.metadata'.*did not finish"
    ):
        read_dcp_layout(str(flat), Storage())
    with pytest.raises(CheckpointFormatError, match=r"not a PyTorch DCP checkpoint"):
        read_dcp_layout(str(tmp_path), Storage())


def test_truncated_chunk(flat: Path) -> None:
    data = (flat / "__1_0.distcp").read_bytes()
    (flat / "__1_0.distcp").write_bytes(data[: len(data) - 700])
    with pytest.raises(
        CheckpointFormatError, match=r"__1_0.distcp: chunk of '.*' .*the file is truncated"
    ):
        read_dcp_layout(str(flat), Storage())


def test_chunk_length_disagrees(flat: Path) -> None:
    def shorten(meta: Any) -> None:
        key = _storage_of(meta, "w", (0, 0))
        meta.storage_data[key].length -= 10

    _edit_metadata(flat, shorten)
    with pytest.raises(
        CheckpointFormatError, match=r"chunk of 'w' at offsets \[0, 0\].*length disagrees"
    ):
        read_dcp_layout(str(flat), Storage())


def test_overlapping_chunks(flat: Path) -> None:
    def grow(meta: Any) -> None:
        import torch

        chunk = meta.state_dict_metadata["w"].chunks[0]
        chunk.sizes = torch.Size([6, 4])

    _edit_metadata(flat, grow)
    with pytest.raises(LayoutMismatchError, match=r"'w': chunks overlap at element \[5, 0\]"):
        read_dcp_layout(str(flat), Storage())


def test_missing_chunk(flat: Path) -> None:
    _edit_metadata(flat, lambda meta: meta.state_dict_metadata["v"].chunks.pop())
    with pytest.raises(
        LayoutMismatchError, match=r"'v': the chunks hold 16 of the 28 .*\[0, 4\] is in no chunk"
    ):
        read_dcp_layout(str(flat), Storage())


def test_transform_is_refused_by_name(flat: Path) -> None:
    def compress(meta: Any) -> None:
        meta.storage_data[_storage_of(meta, "w", (5, 0))].transform_descriptors = ["zstd"]

    _edit_metadata(flat, compress)
    with pytest.raises(
        UnsupportedCheckpointError,
        match=r"'w' was saved through the stream transform\(s\) \['zstd'\]",
    ):
        read_dcp_layout(str(flat), Storage())


@pytest.mark.parametrize("where", ["../elsewhere/__0_0.distcp", "absolute"])
def test_storage_outside_the_folder_is_refused_at_plan_time(
    flat: Path, tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24, 13: a `relative_path` with `..` (or an absolute one) gave a KeyError, exit 1."""
    # A real file there, so nothing but the path itself can refuse it.
    outside = tmp_path / "elsewhere" / "__0_0.distcp"
    outside.parent.mkdir()
    shutil.copy(flat / "__0_0.distcp", outside)
    found = str(outside) if where == "absolute" else where

    def point_outside(meta: Any) -> None:
        meta.storage_data[_storage_of(meta, "w", (0, 0))].relative_path = found

    _edit_metadata(flat, point_outside)
    with pytest.raises(CheckpointFormatError) as e:
        read_dcp_layout(str(flat), Storage())
    message = str(e.value)
    assert message.startswith(f"{flat}/.metadata: ") and f"'{found}'" in message
    assert "outside the checkpoint folder" in message and "\n" not in message
    from zerosafe_app.cli import main

    assert main(["convert", str(flat), str(tmp_path / "out"), "--via", "local"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "outside the checkpoint folder" in err
    assert not list((tmp_path / "out").glob("*.safetensors"))


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getcwd, ())


def test_unsafe_global_is_refused_by_name(flat: Path) -> None:
    def inject(meta: Any) -> None:
        meta.planner_data = _Payload()

    _edit_metadata(flat, inject)
    with pytest.raises(
        UnsafePickleError, match=r"names the global 'posix.getcwd'.*not on zerosafe's allowlist"
    ):
        read_dcp_layout(str(flat), Storage())


def test_not_dcp_metadata(flat: Path) -> None:
    (flat / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointFormatError, match=r"is dict .*expected a 'Metadata'"):
        read_dcp_layout(str(flat), Storage())
    data = pickle.dumps([1, 2, 3])
    (flat / ".metadata").write_bytes(data[:-3])
    with pytest.raises(CheckpointFormatError, match=r"could not be read .*truncated or corrupt"):
        read_dcp_layout(str(flat), Storage())


def test_a_fifo_named_metadata_is_refused_not_waited_on(flat: Path, tmp_path: Path) -> None:
    """Issue 37 item 8: a FIFO named `.metadata` hung `convert` forever."""
    (flat / ".metadata").unlink()
    os.mkfifo(flat / ".metadata")
    proc = zerosafe_child("convert", "--via", "local", flat, tmp_path / "out", timeout_s=60)
    assert_refused_in_one_line(
        proc, f"{flat}/.metadata: expected PyTorch DCP's metadata", "found a FIFO"
    )
