"""Finding the save one level below the folder passed, for any reader (fast: DCP folders
written in-process by torch.distributed.checkpoint, and the shipped DeepSpeed ZeRO-3 sample)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.conftest import SAMPLE_LIVE
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.registry import find_save, quick_identities, read_source
from zerosafe.io.storage import Storage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _dcp(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    weights = {"embed.weight": torch.randn(5, 3), "head.weight": torch.randn(2, 3)}
    dcp.save({"model": dict(weights)}, checkpoint_id=str(folder), no_dist=True)
    return weights


def test_one_dcp_save_one_level_down_converts(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-4"
    weights = _dcp(ckpt / "pytorch_model_fsdp_0")
    (ckpt / ".cache").mkdir()  # hidden folders are never candidates
    (ckpt / "config.json").write_text(json.dumps({"model_type": "toy"}))
    storage = Storage()
    found = find_save(storage, str(ckpt))
    assert found.nested and found.reader.name == "dcp" and found.given == str(ckpt)
    assert found.url == f"{ckpt}/pytorch_model_fsdp_0"
    tag, identities = quick_identities(storage, str(ckpt), None)
    assert (tag, identities) == quick_identities(storage, found.url, None)
    summary = convert_checkpoint(str(ckpt), str(tmp_path / "out"))
    assert f"converting {found.url} (the only save in {ckpt}: PyTorch DCP)" in summary.notes
    assert not any("beside it" in n for n in summary.notes)  # .cache/ is hidden: not listed
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in weights.items()) and sorted(got) == sorted(
        weights
    )
    assert (tmp_path / "out" / "config.json").read_text() == (ckpt / "config.json").read_text()


def test_a_deepspeed_save_one_level_down_converts(sample_ckpt: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    shutil.move(str(sample_ckpt), run / "ckpt")
    layout = read_source(Storage(), str(run), tag=None, options=ConvertOptions())
    assert layout.format == "deepspeed" and layout.where == f"{run}/ckpt/global_step2"
    assert layout.notes[0] == f"converting {run}/ckpt (the only save in {run}: DeepSpeed ZeRO)"
    assert layout.source.found_in == str(run)


def test_saves_of_two_formats_are_listed(sample_ckpt: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    shutil.move(str(sample_ckpt), run / "ds")
    _dcp(run / "step-10")
    with pytest.raises(CheckpointFormatError) as e:
        find_save(Storage(), str(run))
    assert str(e.value) == (
        f"{run}: holds 2 saves one level down: ds/ (DeepSpeed ZeRO), step-10/ (PyTorch DCP); "
        "zerosafe converts one save at a time: pass the folder of the one to convert "
        f"(e.g. {run}/ds)"
    )


def test_a_save_claimed_at_the_top_is_never_searched_below(tmp_path: Path) -> None:
    """A DCP folder is one save even if a subfolder holds another."""
    top = tmp_path / "step-10"
    _dcp(top)
    _dcp(top / "inner", seed=1)
    found = find_save(Storage(), str(top))
    assert not found.nested and found.url == str(top) and found.note == ""


def _two_saves(sample_ckpt: Path, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Trainer's `checkpoint-4/` holding a DeepSpeed save (`latest` + `global_step2/`, the
    shipped ZeRO-3 sample) and a DCP save in `pytorch_model_fsdp_0/` (accelerate FSDP2's
    folder; `optimizer_0/` beside it is never a candidate)."""
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(sample_ckpt, ckpt)
    weights = _dcp(ckpt / "pytorch_model_fsdp_0")
    _dcp(ckpt / "optimizer_0", seed=1)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return ckpt, weights


def _two_saves_line(ckpt: Path) -> str:
    return (
        f"{ckpt}: holds 2 saves: {ckpt} itself (DeepSpeed ZeRO) and pytorch_model_fsdp_0/ "
        "(PyTorch DCP); zerosafe converts one save at a time: pass the folder of the one to "
        f"convert (e.g. {ckpt}/pytorch_model_fsdp_0), or, for the DeepSpeed ZeRO save in "
        f"{ckpt} itself, `--tag` naming its tag folder"
    )


def test_a_save_beside_the_one_claimed_is_listed(sample_ckpt: Path, tmp_path: Path) -> None:
    """Issue 37 item 7: the DeepSpeed reader claimed `checkpoint-4/` and the DCP save in
    `pytorch_model_fsdp_0/` was never mentioned."""
    ckpt, _ = _two_saves(sample_ckpt, tmp_path)
    storage = Storage()
    with pytest.raises(CheckpointFormatError) as e:
        find_save(storage, str(ckpt))
    assert str(e.value) == _two_saves_line(ckpt)
    with pytest.raises(CheckpointFormatError, match="holds 2 saves"):
        quick_identities(storage, str(ckpt), None)
    found = find_save(storage, str(ckpt), tag="global_step2")  # `--tag` picks the DeepSpeed one
    assert found.reader.name == "deepspeed" and not found.nested
    convert_checkpoint(str(ckpt), str(tmp_path / "out"), tag="global_step2")
    got, live = load_file(tmp_path / "out" / "model.safetensors"), load_file(SAMPLE_LIVE)
    assert sorted(got) == sorted(live)  # fp32 masters, the bf16 live weights when cast
    assert all(torch.equal(got[k].to(v.dtype), v) for k, v in live.items())
    found = find_save(storage, f"{ckpt}/pytorch_model_fsdp_0")
    assert found.reader.name == "dcp" and not found.nested


def test_a_tag_folder_and_its_universal_folder_are_one_save(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """A DeepSpeed folder's tag folders and the universal folder ds_to_universal.py made of one
    are parts of its save; a folder no reader claims (logs) is no save."""
    universal = sample_ckpt / "global_step2_universal"
    (universal / "zero" / "w").mkdir(parents=True)
    (universal / "zero" / "w" / "fp32.pt").write_bytes(b"")
    (sample_ckpt / "global_step1").mkdir()
    (sample_ckpt / "runs").mkdir()
    found = find_save(Storage(), str(sample_ckpt))
    assert found.reader.name == "deepspeed" and not found.nested


def test_a_dcp_save_beside_a_deepspeed_one_is_not_converted(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """The command refuses (exit 2, one line) for `convert` and `inspect`; the subfolder passed
    itself converts."""
    ckpt, weights = _two_saves(sample_ckpt, tmp_path)
    out = tmp_path / "out"
    for args in (["convert", str(ckpt), str(out), "--via", "local"], ["inspect", str(ckpt)]):
        proc = _cli(*args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and _two_saves_line(ckpt) in lines[0], proc.stderr
        assert not out.exists()
    proc = _cli("convert", f"{ckpt}/pytorch_model_fsdp_0", str(out), "--via", "local")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(weights)
    assert all(torch.equal(got[k], v) for k, v in weights.items())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_folders_beside_the_save_are_listed_not_read(tmp_path: Path) -> None:
    """ByteCheckpoint's `global_step_N/`: `model/` is converted; `optimizer/` (optimizer
    state) and `extra_state/` (per-rank trainer state, no reader claims it) are named in a
    note, so `inspect` shows what was left (issue 39)."""
    step = tmp_path / "global_step_3"
    _dcp(step / "model")
    _dcp(step / "optimizer", seed=1)
    (step / "extra_state").mkdir()
    torch.save({"step": 3}, step / "extra_state" / "extra_state_rank_0.pt")
    layout = read_source(Storage(), str(step), tag=None, options=ConvertOptions())
    assert layout.where == f"{step}/model"
    assert layout.notes[:2] == [
        f"converting {step}/model (the only save in {step}: PyTorch DCP)",
        f"not read, beside it in {step}: extra_state/, optimizer/",
    ]


def _steps(run: Path) -> dict[str, torch.Tensor]:
    """verl's and ByteCheckpoint's checkpoint folder: `global_step_N/model/` per step and
    `latest_checkpointed_iteration.txt` naming the latest (here 3; step 1 is older)."""
    _dcp(run / "global_step_1" / "model", seed=1)
    weights = _dcp(run / "global_step_3" / "model", seed=3)
    (run / "global_step_3" / "extra_state").mkdir()
    (run / "latest_checkpointed_iteration.txt").write_text("3")
    return weights


def test_the_step_latest_checkpointed_iteration_names_converts(tmp_path: Path) -> None:
    run = tmp_path / "ckpt"
    weights = _steps(run)
    found = find_save(Storage(), str(run))
    assert found.url == f"{run}/global_step_3/model" and found.given == str(run)
    summary = convert_checkpoint(str(run), str(tmp_path / "out"))
    assert list(summary.notes[:2]) == [
        f"converting {run}/global_step_3/model (the only save in global_step_3, the step "
        "latest_checkpointed_iteration.txt names: PyTorch DCP)",
        f"not read, beside it in {run}/global_step_3: extra_state/",
    ]
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(weights) and all(torch.equal(got[k], weights[k]) for k in got)


@pytest.mark.parametrize(
    ("text", "match"),
    [("7", "names step 7, but .*global_step_7 is not there .*'global_step_1', 'global_step_3'"),
     ("step3\n", "holds 'step3', expected the number of the latest step")],
)  # fmt: skip
def test_a_latest_step_file_that_names_no_step_is_refused(
    tmp_path: Path, text: str, match: str
) -> None:
    run = tmp_path / "ckpt"
    _steps(run)
    (run / "latest_checkpointed_iteration.txt").write_text(text)
    with pytest.raises(CheckpointFormatError, match=match):
        find_save(Storage(), str(run))
