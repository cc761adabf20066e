"""Which folder a DeepSpeed universal checkpoint is read from, from listings alone (the
conversions themselves, of real ds_to_universal.py output, are in test_universal.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.deepspeed.universal import find_universal_tag
from zerosafe.formats.registry import detect_format
from zerosafe.io.storage import Storage


def _universal(folder: Path) -> Path:
    (folder / "zero" / "embed.weight").mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"")
    return folder


def test_folder_resolution(tmp_path: Path) -> None:
    storage = Storage()
    root = tmp_path / "ckpt"
    _universal(root / "global_step4_universal")
    (root / "global_step4").mkdir()
    (root / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (root / "latest_universal").write_text("global_step4_universal")

    want = ("global_step4_universal", str(root / "global_step4_universal"))
    assert find_universal_tag(storage, str(root), None) == want
    assert find_universal_tag(storage, str(root / "global_step4_universal"), None) == want
    assert find_universal_tag(storage, str(root), "global_step4_universal") == want
    assert detect_format(storage, str(root)).name == "deepspeed-universal"

    (root / "latest").write_text("global_step4")  # the ZeRO tag wins without --tag
    assert detect_format(storage, str(root)).name == "deepspeed"
    assert detect_format(storage, str(root), "global_step4_universal").name == "deepspeed-universal"
    assert detect_format(storage, str(root), "global_step4").name == "deepspeed"
    assert detect_format(storage, str(root / "global_step4_universal")).name == (
        "deepspeed-universal"
    )


def test_bad_folders_are_refused(tmp_path: Path) -> None:
    storage = Storage()
    root = tmp_path / "ckpt"
    _universal(root / "u")
    (root / "zero_tag").mkdir()
    with pytest.raises(CheckpointFormatError, match=r"no universal folder 'zero_tag'.*\['u'\]"):
        find_universal_tag(storage, str(root), "zero_tag")
    (root / "latest_universal").write_text("gone")
    with pytest.raises(CheckpointFormatError, match="names 'gone' but .*did ds_to_universal.py"):
        find_universal_tag(storage, str(root), None)
    (root / "latest_universal").write_text("  \n")
    with pytest.raises(CheckpointFormatError, match="found an empty file"):
        find_universal_tag(storage, str(root), None)
    (root / "latest_universal").write_text("../elsewhere")
    with pytest.raises(CheckpointFormatError, match="not a folder name inside"):
        find_universal_tag(storage, str(root), None)
    with pytest.raises(CheckpointFormatError, match="is a file"):
        find_universal_tag(storage, str(root / "latest_universal"), None)
