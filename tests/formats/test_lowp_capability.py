"""`--check-lowp` is refused at plan time where the checkpoint keeps no 16-bit copy (issue 24
item 10): before the fix a ZeRO-3 conversion did all its work and published with the check
skipped. Whether a format (and a checkpoint) has the copy is a reader capability, not a test of
the format's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import ConfigError
from zerosafe.formats.base import ReadsLowpCopies
from zerosafe.formats.registry import READERS, check_options
from zerosafe_app.cli import main


def test_check_lowp_on_zero3_is_refused_before_any_work(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"ZeRO-3 saves no 16-bit copy.*drop `--check-lowp`"):
        convert_checkpoint(str(sample_ckpt), str(out), ConvertOptions(check_lowp=True))
    left = sorted(p.name for p in out.rglob("*")) if out.exists() else []
    assert not [n for n in left if n.endswith((".safetensors", ".bin", ".partial"))], left


def test_check_lowp_on_zero3_is_one_line_exit_2(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["convert", "--via", "local", "--check-lowp", str(sample_ckpt), str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("zerosafe: error: ") and err.count("\n") == 1, err
    assert "--check-lowp" in err


def test_formats_declare_the_16_bit_copy_and_check_options_refuses_by_it() -> None:
    by_name = {r.name: r for r in READERS}
    assert not isinstance(by_name["dcp"], ReadsLowpCopies)
    assert isinstance(by_name["deepspeed"], ReadsLowpCopies)
    with pytest.raises(ConfigError, match="keeps no 16-bit copy"):
        check_options(by_name["dcp"], "/ckpt", ConvertOptions(check_lowp=True))
    check_options(by_name["deepspeed"], "/ckpt", ConvertOptions(check_lowp=True))
