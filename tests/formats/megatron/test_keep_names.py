"""`--keep-names` (issue 40): Megatron's own names, layers unstacked, for a mapping of one's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.formats.megatron.conftest import live_weights, save_path
from zerosafe.config import ConvertOptions
from zerosafe_app.cli import main

SAVED_AS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
"""megatron-core's `sharded_state_dict` saves the local spec's norms under the Transformer
Engine spec's names (the norms fused into the next linear layer): the names of the save."""


def _saved_name(live_name: str) -> str:
    layer, _, rest = live_name.rpartition(".layers.")[2].partition(".")
    if live_name.startswith("decoder.layers.") and rest in SAVED_AS:
        return f"decoder.layers.{layer}.{SAVED_AS[rest]}"
    return live_name


def test_keep_names_writes_the_live_weights_as_megatron_names_them(
    megatron_save: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every layer unstacked into the save's names (the live model's, the norms as
    megatron-core saves them), nothing split or trimmed (the padded vocabulary kept), bit for
    bit; no config.json generated."""
    out = tmp_path / "out"
    code = main(["convert", str(save_path(megatron_save)), str(out), "--via", "local",
                 "--keep-names"])  # fmt: skip
    said = capsys.readouterr()
    assert code == 0, said.err
    assert "--keep-names" in said.out
    got = load_file(str(out / "model.safetensors"))
    want = {_saved_name(k): v for k, v in live_weights(megatron_save).items()}
    assert sorted(got) == sorted(want)
    assert list(got)[0].startswith("embedding.")
    for name, ref in want.items():
        assert got[name].dtype == ref.dtype and torch.equal(got[name], ref), name
    assert not (out / "config.json").exists()
    assert main(["verify", str(out), "--against", str(save_path(megatron_save))]) == 0
    assert capsys.readouterr().out.startswith("OK")


def test_keep_names_is_part_of_the_job_key() -> None:
    """It changes the output's names and bytes: a job with it is another job."""
    plain, kept = ConvertOptions(), ConvertOptions(keep_names=True)
    assert "keep_names" not in plain.identity()  # every existing job keeps its key
    assert kept.identity() == plain.identity() | {"keep_names": True}


def test_keep_names_is_refused_for_other_formats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "model"
    src.mkdir()
    save_file({"w": torch.ones(2, 2)}, str(src / "model.safetensors"))
    code = main(["convert", str(src), str(tmp_path / "out"), "--via", "local", "--keep-names"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "`--keep-names` applies only to Megatron-LM torch_dist checkpoints" in lines[0]
    assert "drop `--keep-names`" in lines[0]
