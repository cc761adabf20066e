"""`mp_rank_01` and up without pipeline layer files: sequence-parallel ranks named as
model-parallel (converted), replicated ranks (converted once), tensor parallelism (refused,
naming what the checkpoint lacks).

DeepSpeed 0.19.8 names Ulysses sequence-parallel ranks `mp_rank_00` (the fix of DeepSpeed PR
8226), and CPU training has no tensor parallelism, so these layouts are made from real
checkpoints by renaming and copying their files the way the older DeepSpeed names them:
rank r's files carry its sequence-parallel rank (`zero_pp_rank_{r}_mp_rank_{sp:02d}`), or every
`mp_rank_00` file again as `mp_rank_01`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import SHARED_FIXTURES
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import UnsupportedCheckpointError
from zerosafe.io.storage import Storage
from zerosafe.plan.build import plan_checkpoint
from zerosafe_app.cli import main

TAG = "global_step2"


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def _same_output(ckpt: Path, reference: Path, tmp_path: Path) -> list[str]:
    """Convert `ckpt` and `reference`; assert equal outputs; return `ckpt`'s plan notes."""
    ours = convert_checkpoint(str(ckpt), str(tmp_path / "ours"))
    want = convert_checkpoint(str(reference), str(tmp_path / "want"))
    assert ours.status == want.status == "converted"
    got, expected = _tensors(tmp_path / "ours"), _tensors(tmp_path / "want")
    assert set(got) == set(expected)
    for key, t in expected.items():
        assert torch.equal(got[key].view(torch.uint8), t.view(torch.uint8)), key
    again = convert_checkpoint(str(ckpt), str(tmp_path / "ours"))
    assert again.status == "already-complete"  # quick_identities lists the files it read
    _, plan = plan_checkpoint(Storage(), str(ckpt), tag=None, options=ConvertOptions())
    return plan.notes


def _sp_rename(tag: Path, ranks: range) -> None:
    """Older DeepSpeed's names for Ulysses: rank r's files under its sequence-parallel rank."""
    for r in ranks:
        for f in tag.glob(f"*zero_pp_rank_{r}_mp_rank_00_*.pt"):
            f.rename(f.with_name(f.name.replace("_mp_rank_00_", f"_mp_rank_{r:02d}_")))


def test_zero3_sequence_parallel_names_convert(sample_ckpt: Path, tmp_path: Path) -> None:
    renamed = tmp_path / "renamed"
    shutil.copytree(sample_ckpt, renamed)
    _sp_rename(renamed / TAG, range(1, 3))
    assert (renamed / TAG / "zero_pp_rank_2_mp_rank_02_model_states.pt").is_file()
    notes = _same_output(renamed, sample_ckpt, tmp_path)
    assert any("sequence-parallel ranks named as model-parallel" in n for n in notes), notes


@pytest.mark.skipif(not SHARED_FIXTURES.is_dir(), reason="needs ../shared/fixtures")
def test_zero1_sequence_parallel_names_convert(tmp_path: Path) -> None:
    """ZeRO-1/2: only data-parallel rank 0 writes `mp_rank_00_model_states.pt`."""
    src = SHARED_FIXTURES / "z1-bf16-ws2-basic" / "checkpoint"
    renamed = tmp_path / "renamed"
    shutil.copytree(src, renamed)
    tag = renamed / (renamed / "latest").read_text().strip()
    _sp_rename(tag, range(1, 2))
    assert (tag / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt").is_file()
    notes = _same_output(renamed, src, tmp_path)
    assert any("sequence-parallel ranks named as model-parallel" in n for n in notes), notes


def test_recorded_model_parallel_size_is_tensor_parallel(sample_ckpt: Path, tmp_path: Path) -> None:
    _sp_rename(sample_ckpt / TAG, range(1, 3))
    path = sample_ckpt / TAG / "zero_pp_rank_1_mp_rank_01_model_states.pt"
    states = torch.load(path, weights_only=True)  # test-only surgery; no DeepSpeed classes
    states["mp_world_size"] = 2
    torch.save(states, path)
    with pytest.raises(UnsupportedCheckpointError) as err:
        convert_checkpoint(str(sample_ckpt), str(tmp_path / "out"))
    text = str(err.value)
    assert "tensor-parallel checkpoints (mp_rank_01) are not supported yet" in text
    assert "model-parallel world size of 2" in text
    assert "does not record how each parameter is split" in text


def _replicate(tag: Path) -> None:
    for f in sorted(tag.glob("*mp_rank_00_*.pt")):
        shutil.copy(f, f.with_name(f.name.replace("_mp_rank_00_", "_mp_rank_01_")))


def test_replicated_ranks_convert_once(sample_ckpt: Path, tmp_path: Path) -> None:
    replicated = tmp_path / "replicated"
    shutil.copytree(sample_ckpt, replicated)
    _replicate(replicated / TAG)
    notes = _same_output(replicated, sample_ckpt, tmp_path)
    assert any("byte-for-byte copies of mp_rank_00" in n for n in notes), notes


def test_tensor_parallel_contents_are_refused(sample_ckpt: Path, tmp_path: Path, capsys) -> None:
    """Same names under mp_rank_00 and mp_rank_01, other contents: tensor-parallel shards."""
    _replicate(sample_ckpt / TAG)
    path = sample_ckpt / TAG / "zero_pp_rank_0_mp_rank_01_model_states.pt"
    states = torch.load(path, weights_only=True)
    fragments = states["frozen_param_fragments"]
    name = next(iter(fragments))
    fragments[name] = fragments[name] * 2  # another slice of the param
    torch.save(states, path)
    with pytest.raises(UnsupportedCheckpointError) as err:
        convert_checkpoint(str(sample_ckpt), str(tmp_path / "out"))
    text = str(err.value)
    assert text.startswith(
        f"{path}: tensor-parallel checkpoints (mp_rank_01) are not supported yet"
    )
    assert "contents differ from zero_pp_rank_0_mp_rank_00_model_states.pt" in text
    assert "does not record how each parameter is split across the model-parallel ranks" in text
    assert "universal_checkpoint_info" in text
    code = main(["convert", "--via", "local", str(sample_ckpt), str(tmp_path / "out2")])
    err_text = capsys.readouterr().err
    assert code == 2 and err_text.count("\n") == 1 and "tensor-parallel" in err_text


def test_recorded_tensor_parallel_degree_is_refused(sample_ckpt: Path, tmp_path: Path) -> None:
    _replicate(sample_ckpt / TAG)
    path = sample_ckpt / TAG / "zero_pp_rank_1_mp_rank_01_model_states.pt"
    states = torch.load(path, weights_only=True)
    states["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 2}
    torch.save(states, path)
    with pytest.raises(UnsupportedCheckpointError, match="tensor-parallel degree 2"):
        convert_checkpoint(str(sample_ckpt), str(tmp_path / "out"))


def test_incomplete_model_parallel_rank_is_refused(sample_ckpt: Path, tmp_path: Path) -> None:
    _replicate(sample_ckpt / TAG)
    (sample_ckpt / TAG / "bf16_zero_pp_rank_2_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(UnsupportedCheckpointError) as err:
        convert_checkpoint(str(sample_ckpt), str(tmp_path / "out"))
    text = str(err.value)
    assert "mp_rank_01 has 5 file(s) but mp_rank_00 has 6" in text
    assert "lacks the optim file of rank 2" in text
