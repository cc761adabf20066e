"""A folder no reader claims is refused naming what it looks like (issue 39), and DeepSpeed's
own message is kept for folders that show something of DeepSpeed's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from zerosafe.formats.resemble import looks_like_deepspeed, resemblance
from zerosafe.io.storage import Storage


def _folder(root: Path, files: list[str], folders: list[str] = ()) -> Path:
    root.mkdir()
    for name in files:
        (root / name).write_bytes(b"x")
    for name in folders:
        (root / name).mkdir()
    return root


def _refusal(folder: Path, tmp_path: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", str(folder), str(tmp_path / "out")],
        capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(REPO),
        "PATH": "/usr/bin:/bin", "PREFECT_HOME": str(tmp_path / "ph")}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("files", "folders", "said"),
    [
        (["latest_checkpointed_iteration.txt"], ["iter_0000003"], "a Megatron-LM checkpoint"),
        (["pytorch_model-00001-of-00002.bin", "config.json"], [], "PyTorch `.bin` weights"),
        (["epoch=3-step=100.ckpt"], [], "PyTorch Lightning"),
        (["trainer_state.json", "rng_state.pth"], ["optimizer_0"], "HF Trainer checkpoint"),
        (["weights.pt", "optimizer.pt"], [], "files written by `torch.save`"),
        (["model.Q4_K_M.gguf"], [], "GGUF"),
        (["notes.txt"], [], "nothing in it is a checkpoint zerosafe recognises (notes.txt)"),
    ],
)
def test_names_what_the_folder_looks_like(
    tmp_path: Path, files: list[str], folders: list[str], said: str
) -> None:
    folder = _folder(tmp_path / "ckpt", files, folders)
    assert said in resemblance(Storage(), str(folder), sorted(files + folders))
    assert not looks_like_deepspeed(files + folders)


def test_the_trainer_folder_names_its_subfolders(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "ckpt", ["trainer_state.json"], ["optimizer_0"])
    assert "optimizer_0/" in resemblance(
        Storage(), str(folder), ["optimizer_0", "trainer_state.json"]
    )


def test_deepspeed_signs_keep_deepspeeds_message() -> None:
    for names in (["latest"], ["global_step7"], ["zero_to_fp32.py"],
                  ["zero_pp_rank_0_mp_rank_00_model_states.pt"]):  # fmt: skip
        assert looks_like_deepspeed(names), names


def test_the_command_names_the_layout_in_one_line(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "run", ["weights.pt", "optimizer.pt"], [])
    line = _refusal(folder, tmp_path)
    assert "looks like files written by `torch.save`" in line and "zerosafe reads:" in line
    assert "no 'latest' file" not in line


def test_a_megatron_save_without_its_metadata_is_named(tmp_path: Path) -> None:
    """Megatron's `--save` layout is read now (issue 40): an `iter_N/` whose `.metadata` is
    missing is refused by its reader, naming the folder, not as an unknown layout."""
    folder = _folder(tmp_path / "run", ["latest_checkpointed_iteration.txt"], ["iter_0000003"])
    (folder / "latest_checkpointed_iteration.txt").write_text("3")
    line = _refusal(folder, tmp_path)
    assert "iter_0000003: no '.metadata'" in line and "torch_dist" in line


def test_an_empty_folder_says_so(tmp_path: Path) -> None:
    line = _refusal(_folder(tmp_path / "empty", []), tmp_path)
    assert "an empty folder" in line


def test_a_deepspeed_folder_missing_its_tag_keeps_deepspeeds_message(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "ds", ["zero_to_fp32.py"], ["global_step3"])
    line = _refusal(folder, tmp_path)
    assert "no 'latest' file" in line
