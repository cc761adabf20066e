"""What inspect and the manifest say must be true of this checkpoint: frozen parameters that
are absent say so, a tensor larger than the shard size says so, and the memory line is the
peak this checkpoint's tasks need (not the budget's ceiling, which no small model reaches)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import SAMPLE_CKPT
from zerosafe_app.cli import main


def _inspect(capsys, *argv: str) -> dict:
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_exclude_frozen_says_so_in_the_manifest(tmp_path: Path, capsys) -> None:
    report = _inspect(capsys, str(SAMPLE_CKPT), "--exclude-frozen")
    assert any("frozen param(s) left out" in n and "side.weight" in n for n in report["notes"])
    out = tmp_path / "o"
    assert (
        main(["convert", "--via", "local", "-q", "--exclude-frozen", str(SAMPLE_CKPT), str(out)])
        == 0
    )
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert any("frozen param(s) left out" in n for n in manifest["notes"]), manifest["notes"]
    assert not any("left out" in n for n in _inspect(capsys, str(SAMPLE_CKPT))["notes"])


def test_deepspeed_exclude_frozen_parameters_is_noted(sample_ckpt: Path, capsys) -> None:
    # What DeepSpeed's save_checkpoint(exclude_frozen_parameters=True) changes in the model
    # states (engine.py `_save_checkpoint`): no frozen shapes or fragments, and a module
    # state dict without the frozen params.
    for path in (sample_ckpt / "global_step2").glob("*model_states.pt"):
        state = torch.load(path, weights_only=False)
        state["frozen_param_shapes"] = None
        state["frozen_param_fragments"] = None
        for name in ("side.weight", "side.bias", "side_out.weight"):
            state["module"].pop(name, None)
        torch.save(state, path)
    report = _inspect(capsys, str(sample_ckpt))
    assert report["params"]["frozen"] == []
    assert any("exclude_frozen_parameters" in n for n in report["notes"]), report["notes"]
    assert not any(
        "exclude_frozen_parameters" in n for n in _inspect(capsys, str(SAMPLE_CKPT))["notes"]
    )


def test_tensor_larger_than_the_shard_size_is_said(capsys) -> None:
    report = _inspect(capsys, str(SAMPLE_CKPT), "--max-shard-size", "5KB")
    assert any("exceed the shard size" in n and "embed.weight" in n for n in report["notes"])
    assert main(["inspect", str(SAMPLE_CKPT), "--max-shard-size", "5KB"]) == 0
    assert "holding one larger tensor each" in capsys.readouterr().out
    report = _inspect(capsys, str(SAMPLE_CKPT))
    assert not any("exceed the shard size" in n for n in report["notes"])


def test_memory_line_is_this_checkpoints_peak(capsys) -> None:
    mem = _inspect(capsys, str(SAMPLE_CKPT))["memory"]
    # 65 KB of weights: 8 buffers of its largest piece (15.5 KB) per task, not 58 MB chunks.
    assert mem["buffer_bytes"] <= 16_000
    assert mem["peak_bytes"] < mem["budget_peak_bytes"] <= mem["budget_bytes"]
    assert main(["inspect", str(SAMPLE_CKPT)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Memory"))
    assert "for this checkpoint" in line and "bounds any checkpoint" in line
