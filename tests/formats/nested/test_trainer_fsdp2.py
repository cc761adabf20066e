"""`zerosafe convert checkpoint-4/` for the HF Trainer's accelerate FSDP2 save: the folder a
user has holds the weights one level down (`pytorch_model_fsdp_0/`, a DCP folder), beside
`optimizer_0/` (DCP, optimizer state only) and the model files.

Real parts: the save is written by accelerate's own `save_fsdp_model`/`save_fsdp_optimizer`
from a model sharded with FSDP2 on 2 CPU ranks (`make_trainer_fsdp2.py`, which says why the
Trainer itself is not run), and the output is loaded with the real transformers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # a test dependency (the `test` extra): a missing one fails, never skips
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def _cli(env: dict[str, str] | None, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip


def _convert(env: dict[str, str] | None, ckpt: Path, out: Path, *args: str) -> dict[str, Any]:
    proc = _cli(env, "convert", "--json", str(ckpt), str(out), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary: dict[str, Any] = json.loads(proc.stdout)
    return summary


def test_the_folder_a_user_has_converts_bit_exact_and_loads(
    trainer_fsdp2: Path, prefect_env: dict[str, str], tmp_path: Path
) -> None:
    ckpt, out = trainer_fsdp2 / "checkpoint-4", tmp_path / "out"
    summary = _convert(prefect_env, ckpt, out)  # the real command: the Prefect flow
    assert summary["status"] == "converted" and not summary["warnings"]
    assert (
        f"converting {ckpt}/pytorch_model_fsdp_0 (the only save in {ckpt}: PyTorch DCP)"
        in (summary["notes"])
    )
    live = load_file(trainer_fsdp2 / "live.safetensors")
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(live)
    for name, tensor in live.items():  # bit-exact against the live weights
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert manifest["source"]["checkpoint"] == f"{ckpt}/pytorch_model_fsdp_0"
    assert manifest["source"]["found_in"] == str(ckpt)
    assert manifest["model_files_from"] == str(ckpt)  # the folder the user gave
    assert [e["file"] for e in manifest["model_files"]] == ["config.json", "generation_config.json"]
    assert not any(
        ".distcp" in f["url"] and "optimizer_0" in f["url"] for f in manifest["source"]["files"]
    )
    ids = load_file(trainer_fsdp2 / "input-ids.safetensors")["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the live model ran (OMP_NUM_THREADS=1): the same sums
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(logits, load_file(trainer_fsdp2 / "live-logits.safetensors")["logits"])

    # The job reads the save found, whichever folder is passed: the same job, already done.
    direct = _convert(None, ckpt / "pytorch_model_fsdp_0", out, "--via", "local")
    assert direct["status"] == "already-complete" and direct["job_key"] == summary["job_key"]
    again = _convert(None, ckpt, out, "--via", "local")
    assert again["status"] == "already-complete"
    verify = _cli(None, "verify", str(out), "--against", str(ckpt))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"against {ckpt}/pytorch_model_fsdp_0 " in verify.stdout
    inspect = _cli(None, "inspect", str(ckpt))
    assert inspect.returncode == 0, inspect.stderr
    assert f"converting {ckpt}/pytorch_model_fsdp_0" in inspect.stdout


def test_two_saves_one_level_down_are_listed_and_refused(
    trainer_fsdp2: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(trainer_fsdp2 / "checkpoint-4", ckpt)
    shutil.copytree(ckpt / "pytorch_model_fsdp_0", ckpt / "pytorch_model_fsdp_1")
    proc = _cli(None, "convert", str(ckpt), str(tmp_path / "out"), "--via", "local")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert "holds 2 saves one level down: pytorch_model_fsdp_0/ (PyTorch DCP), " in error
    assert "pytorch_model_fsdp_1/ (PyTorch DCP)" in error
    assert f"pass the folder of the one to convert (e.g. {ckpt}/pytorch_model_fsdp_0)" in error
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # Passing one of them converts it.
    assert (
        _convert(None, ckpt / "pytorch_model_fsdp_1", tmp_path / "one", "--via", "local")["status"]
        == "converted"
    )


def test_an_optimizer_folder_alone_is_no_save(trainer_fsdp2: Path, tmp_path: Path) -> None:
    """accelerate's `optimizer_0/` (a DCP folder of optimizer state) is never taken for the
    weights: a folder holding only it is refused, not converted into optimizer tensors."""
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(trainer_fsdp2 / "checkpoint-4", ckpt)
    shutil.rmtree(ckpt / "pytorch_model_fsdp_0")
    proc = _cli(None, "convert", str(ckpt), str(tmp_path / "out"), "--via", "local")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "looks like an HF Trainer checkpoint folder without a model save" in proc.stderr
    assert "optimizer_0" in proc.stderr  # named among the folders inside


def test_the_optimizer_folder_passed_itself_is_refused_by_default(
    trainer_fsdp2: Path, tmp_path: Path
) -> None:
    """`optimizer_0/` holds AdamW's moments and steps and no weights: converted by default,
    they would be a `model.safetensors` beside a `config.json`. `--select` converts them."""
    optim = trainer_fsdp2 / "checkpoint-4" / "optimizer_0"
    proc = _cli(None, "convert", str(optim), str(tmp_path / "out"), "--via", "local")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds optimizer state only (63 tensors under 'optimizer.state'" in proc.stderr
    assert "pass that folder, or `--select optimizer.state`" in proc.stderr
    summary = _convert(
        None, optim, tmp_path / "state", "--via", "local", "--select", "optimizer.state"
    )
    assert summary["status"] == "converted" and summary["num_tensors"] == 63


def test_a_deepspeed_save_beside_the_fsdp2_one_is_refused(
    trainer_fsdp2: Path, sample_ckpt: Path, tmp_path: Path
) -> None:
    """Issue 37 item 7: `checkpoint-4/` holding DeepSpeed's `latest` and tag folder (the
    shipped ZeRO-3 sample) beside accelerate's `pytorch_model_fsdp_0/` is two saves; the
    DeepSpeed reader claimed the folder and the DCP save was never mentioned."""
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(trainer_fsdp2 / "checkpoint-4", ckpt)
    shutil.copytree(sample_ckpt, ckpt, dirs_exist_ok=True)  # `latest`, `global_step2/`
    out = tmp_path / "out"
    for args in (["convert", str(ckpt), str(out), "--via", "local"], ["inspect", str(ckpt)]):
        proc = _cli(None, *args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith(
            f"zerosafe: error: {ckpt}: holds 2 saves: {ckpt} itself (DeepSpeed ZeRO) and pytorch_model_fsdp_0/ "
            "(PyTorch DCP); "
        )
        assert f"(e.g. {ckpt}/pytorch_model_fsdp_0), or, for the DeepSpeed ZeRO" in lines[0]
        assert "`--tag` naming its tag folder" in lines[0]
        assert not out.exists()
    summary = _convert(None, ckpt / "pytorch_model_fsdp_0", out, "--via", "local")
    assert summary["status"] == "converted"
    live, got = load_file(trainer_fsdp2 / "live.safetensors"), load_file(out / "model.safetensors")
    assert sorted(got) == sorted(live) and all(torch.equal(got[k], v) for k, v in live.items())
