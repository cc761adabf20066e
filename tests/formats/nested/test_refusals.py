"""Saves zerosafe cannot convert, refused in one line (exit 2) that names what was found and
what would convert it: DeepSpeed's DataStates and Nebula engines' files, a tag an
asynchronous writer has not finished, DCP chunks without their `.metadata`.

Neither the DataStates engine (CUDA, and a package not on PyPI) nor Nebula (`torch_nebula`,
Azure only; the engine left DeepSpeed in 0.18) runs here, so their files are written exactly
as their sources write them (each test says which source). The unfinished tag is a
`torch.save` file cut short, as it lies on disk while the decoupled engine's background
writer is still writing it; the DCP folders are written by torch.distributed.checkpoint itself.
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.deepspeed.engines import is_datastates_head
from zerosafe.formats.registry import read_source
from zerosafe.io.storage import Storage

TAG = "global_step2"
NAMES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def _state() -> dict[str, object]:
    """What DeepSpeed hands the engine for ZeRO-2 model states (abridged)."""
    torch.manual_seed(0)
    return {
        "module": {"layer.weight": torch.randn(4, 4), "layer.bias": torch.randn(4)},
        "param_shapes": [{"layer.weight": torch.Size([4, 4]), "layer.bias": torch.Size([4])}],
        "ds_version": "0.19.8",
    }


def _tag_folder(root: Path, write: object, *, latest: str | None = TAG) -> Path:
    tag = root / "ckpt" / TAG
    tag.mkdir(parents=True)
    for name in NAMES:
        write(tag / name)  # type: ignore[operator]
    if latest is not None:
        (root / "ckpt" / "latest").write_text(latest)
    return root / "ckpt"


def _refusal(ckpt: Path, out: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", str(ckpt), str(out), "--via", "local", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr  # one line
    assert not (out / "model.safetensors").exists()
    return lines[0]


def _flatten(
    prefix: str,
    data: object,
    header: dict[str, object],
    tensors: list[torch.Tensor],
    offset: list[int],
    aligned: int,
) -> object:
    """DataStates' `_parse_state`: tensors go to the header with their offsets and leave a
    `TENSOR|key` marker in the pickled rest."""
    if torch.is_tensor(data):
        size = data.numel() * data.element_size()
        header[prefix] = {"dtype": str(data.dtype), "shape": list(data.shape),
                          "offsets": [offset[0], offset[0] + size]}  # fmt: skip
        tensors.append(data.contiguous())
        offset[1] = offset[0] + size
        offset[0] = (offset[1] + aligned - 1) // aligned * aligned
        return f"TENSOR|{prefix}"
    if isinstance(data, dict):
        return {k: _flatten(f"{prefix}|{k}" if prefix else str(k), v, header, tensors, offset, aligned)
                for k, v in data.items()}  # fmt: skip
    return data


def _write_datastates_ckpt_py(path: Path) -> None:
    """As `BaseCheckpointEngine.save_background` (datastates-llm `llm/datastates/ckpt.py`)
    writes: the header's length (8 bytes, little-endian) at 0, the JSON header at 4096
    (`ALIGNMENT`), tensors at aligned offsets after it, the pickled rest at the end."""
    alignment = 4096
    header: dict[str, object] = {}
    tensors: list[torch.Tensor] = []
    offset = [0, 0]
    lean = pickle.dumps(_flatten("", _state(), header, tensors, offset, alignment), protocol=5)
    start = offset[0]
    header["datastates_metadata"] = {
        "offsets": [start, offset[1] + -(-len(lean) // alignment) * alignment]
    }
    raw = json.dumps(header).encode()
    metadata_size = alignment + -(-len(raw) // alignment) * alignment
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.seek(alignment)
        f.write(raw)
        for t, entry in zip(
            tensors, (v for k, v in header.items() if k != "datastates_metadata"), strict=True
        ):
            f.seek(metadata_size + entry["offsets"][0])  # type: ignore[index]
            f.write(t.numpy().tobytes())
        f.seek(metadata_size + start)
        f.write(lean)


def _write_datastates_state_ckpt(path: Path) -> None:
    """As `CheckpointEngine.load` (datastates-llm `llm/datastates/state_ckpt.py`) reads a
    file: the header's length at 0, the JSON header right after it (byte 8), the tensors'
    bytes at `data_offsets` after the header, the pickled rest last."""
    header: dict[str, object] = {}
    tensors: list[torch.Tensor] = []
    offset = [0, 0]
    lean = pickle.dumps(_flatten("", _state(), header, tensors, offset, 1), protocol=5)
    for entry in header.values():
        entry["data_offsets"] = entry.pop("offsets")  # type: ignore[attr-defined]
    header["datastates_metadata"] = {"data_offsets": [offset[1], offset[1] + len(lean)]}
    raw = json.dumps(header).encode()
    body = b"".join(t.numpy().tobytes() for t in tensors) + lean
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)


@pytest.mark.parametrize("writer", [_write_datastates_ckpt_py, _write_datastates_state_ckpt])
def test_datastates_files_are_named(tmp_path: Path, writer: object) -> None:
    ckpt = _tag_folder(tmp_path, writer)
    line = _refusal(ckpt, tmp_path / "out")
    assert "written by DeepSpeed's DataStates checkpoint engine" in line
    assert (
        "not by torch.save" in line
        and "save it again with DeepSpeed's default torch engine" in line
    )
    assert f"{TAG}/" in line  # names the file


def test_datastates_head_is_not_claimed_by_torch_files(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save(_state(), buf)
    raw = buf.getvalue()
    assert not is_datastates_head(raw[:4200], len(raw))
    legacy = io.BytesIO()
    torch.save(_state(), legacy, _use_new_zipfile_serialization=False)
    assert not is_datastates_head(legacy.getvalue()[:4200], len(legacy.getvalue()))


def test_nebula_placeholders_are_named(tmp_path: Path) -> None:
    """`NebulaCheckpointEngine.save` (DeepSpeed 0.8 to 0.17,
    `runtime/checkpoint_engine/nebula_checkpoint_engine.py`) runs `torch.save("", path)` for
    every file, then hands the state to torch_nebula; DeepSpeed writes `latest` as usual."""
    ckpt = _tag_folder(tmp_path, lambda p: torch.save("", p))
    line = _refusal(ckpt, tmp_path / "out")
    assert "an empty placeholder (torch.save of an empty string)" in line
    assert "Nebula checkpoint engine" in line and "persistent_storage_path" in line


def _cut_short(path: Path) -> None:
    buf = io.BytesIO()
    torch.save(_state(), buf)
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])


def test_a_tag_still_being_written_is_not_finished(tmp_path: Path) -> None:
    """The decoupled engine (`decoupled_checkpoint_engine.py`) writes each file from a
    background process and `latest` only at commit: before then the files are cut short and
    `latest` is missing (first save) or names the previous tag."""
    ckpt = _tag_folder(tmp_path, _cut_short, latest=None)
    line = _refusal(ckpt / TAG, tmp_path / "out")
    assert "a torch.save zip without its end record yet" in line
    assert "has no `latest` yet: the save of this tag is not finished" in line
    (ckpt / "latest").write_text("global_step1")
    line = _refusal(ckpt, tmp_path / "out", "--tag", TAG)
    assert (
        "`latest` names 'global_step1', not this tag: if this tag is a save in progress, " in line
    )
    assert "it is not finished" in line and "convert 'global_step1'" in line
    (ckpt / "latest").write_text(TAG)  # committed, yet cut short: damaged, not unfinished
    line = _refusal(ckpt, tmp_path / "out")
    assert "not finished" not in line and "the file is truncated" in line


def test_an_empty_file_is_a_save_not_finished(tmp_path: Path) -> None:
    ckpt = _tag_folder(tmp_path, lambda p: p.write_bytes(b""), latest=None)
    line = _refusal(ckpt / TAG, tmp_path / "out")
    assert "an empty file (0 bytes)" in line and "save of this tag is not finished" in line


def test_a_rank_file_not_written_yet_is_a_save_not_finished(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """Rank 2's optimizer file not there yet (its writer has not reached it) and no `latest`:
    the save is not finished; with `latest` naming the tag, the copy is incomplete."""
    (sample_ckpt / "global_step2" / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    (sample_ckpt / "latest").unlink()
    line = _refusal(sample_ckpt / "global_step2", tmp_path / "out")
    assert "optimizer file for rank(s) [2] missing" in line
    assert "save of this tag is not finished" in line
    (sample_ckpt / "latest").write_text("global_step2")
    line = _refusal(sample_ckpt, tmp_path / "out")
    assert "not finished" not in line and "Copy the whole tag folder" in line


def _dcp_save(folder: Path, seed: int) -> None:
    torch.manual_seed(seed)
    dcp.save({"model": {"w": torch.randn(3, 4)}}, checkpoint_id=str(folder), no_dist=True)


def test_dcp_chunks_without_metadata_are_refused(tmp_path: Path) -> None:
    step = tmp_path / "step-10"
    _dcp_save(step, 0)
    (step / ".metadata").unlink()  # as copied by `cp *`, or before rank 0 finished
    line = _refusal(step, tmp_path / "out")
    assert "PyTorch DCP chunk files (__0_0.distcp) but no `.metadata`" in line
    assert "Copy `.metadata` too" in line


def test_per_rank_dcp_folders_without_metadata_are_refused(tmp_path: Path) -> None:
    for rank in (0, 1):
        _dcp_save(tmp_path / "ckpt" / f"rank_{rank}", rank)
        (tmp_path / "ckpt" / f"rank_{rank}" / ".metadata").unlink()
    line = _refusal(tmp_path / "ckpt", tmp_path / "out")
    assert "2 folder(s) of PyTorch DCP chunk files without a `.metadata` (rank_0/, rank_1/)" in line
    assert "per-rank saves" in line


def test_per_rank_dcp_saves_each_with_its_own_metadata_are_refused(tmp_path: Path) -> None:
    """Each rank saving on its own (`no_dist=True`) writes a `.metadata` of its part only."""
    for rank in (0, 1):
        _dcp_save(tmp_path / "ckpt" / f"rank_{rank}", rank)
    line = _refusal(tmp_path / "ckpt", tmp_path / "out")
    assert "2 folders that look like per-rank saves (rank_0/ (PyTorch DCP), rank_1/" in line
    assert "no global index" in line and "Save from all ranks into one folder" in line


def test_read_source_refuses_the_same_way(tmp_path: Path) -> None:
    """The library path (plan, verify --against) finds the same refusals as the command."""
    step = tmp_path / "step-10"
    _dcp_save(step, 0)
    (step / ".metadata").unlink()
    with pytest.raises(CheckpointFormatError, match="no `.metadata`"):
        read_source(Storage(), str(step), tag=None, options=ConvertOptions())
