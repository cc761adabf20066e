"""`from_pretrained(OUT)` with the real transformers, on models trained under real DeepSpeed.

Two tiny trainings per session (`tests/deepspeed_gen/train_hf.py`, saved as the HF Trainer
does: `save_checkpoint`, then `save_pretrained` of the config, generation config and
tokenizer into the folder above the tag):
- a Llama-style model (untied head), fp32, ZeRO-3 at world size 2;
- a GPT-2-style model with tied embeddings, bf16, ZeRO-2 at world size 2.
Each is converted with the real command (the embedded Prefect flow), loaded with
`AutoModelForCausalLM.from_pretrained(OUT)`, and its logits compared with those the live
engine computed right after saving. ZEROSAFE_DS_CACHE=dir keeps the trainings between runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # a test dependency (the `test` extra): a missing one fails, never skips
from safetensors import safe_open
from safetensors.torch import load_file

from tests.deepspeed_gen import HF_SCRIPT, train_checkpoint

pytestmark = pytest.mark.slow

SPECS = {
    "llama": {"arch": "llama", "stage": 3, "precision": "fp32", "world_size": 2, "steps": 2},
    "gpt2": {"arch": "gpt2", "stage": 2, "precision": "bf16", "world_size": 2, "steps": 2},
}
BF16_EPS = 2.0**-8
"""Relative spacing of bf16 numbers (8 significant bits): one rounding of a value moves it by
at most half of this, relative to its magnitude."""


@pytest.fixture(scope="session")
def hf_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> training folder (`ckpt/`, `live.safetensors`, `live-logits.safetensors`)."""
    cache = os.environ.get("ZEROSAFE_DS_CACHE")
    runs = {}
    for name, spec in SPECS.items():
        key = hashlib.sha256(json.dumps(spec).encode() + HF_SCRIPT.read_bytes()).hexdigest()[:16]
        dest = Path(cache) / f"hf-{name}-{key}" if cache else tmp_path_factory.mktemp(name)
        if not (dest / "live-logits.safetensors").is_file():
            shutil.rmtree(dest, ignore_errors=True)
            train_checkpoint(spec, dest, script=HF_SCRIPT)
        runs[name] = dest
    return runs


def _convert(env: dict[str, str], ckpt: Path, out: Path, *args: str) -> dict[str, Any]:
    """`zerosafe convert --json` as a user runs it (the Prefect flow, embedded)."""
    proc = subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", "--json", str(ckpt), str(out), *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary: dict[str, Any] = json.loads(proc.stdout)
    return summary


def _logits(model_dir: Path, input_ids: torch.Tensor, **kw: Any) -> tuple[Any, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), **kw).eval()
    with torch.no_grad():
        return model, model(input_ids=input_ids).logits


def test_llama_fp32_logits_equal_the_live_model(
    hf_runs: dict[str, Path], prefect_env: dict[str, str], tmp_path: Path
) -> None:
    run, out = hf_runs["llama"], tmp_path / "out"
    summary = _convert(prefect_env, run / "ckpt", out)
    assert summary["status"] == "converted" and not summary["warnings"]
    live = load_file(run / "live-logits.safetensors")
    model, logits = _logits(out, live["input_ids"])
    assert model.dtype == torch.float32 and torch.equal(logits, live["logits"])
    # The tokenizer came along, and encodes as the one saved with the checkpoint.
    text = "w1 w7 w30 [EOS]"
    got = transformers.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"]
    assert got == transformers.AutoTokenizer.from_pretrained(str(run / "ckpt"))(text)["input_ids"]
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert [e["file"] for e in manifest["model_files"]] == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "verify", str(out), "--against", str(run / "ckpt")],
        capture_output=True, text=True, env=prefect_env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_llama_bf16_with_norms_kept_in_fp32(
    hf_runs: dict[str, Path], prefect_env: dict[str, str], tmp_path: Path
) -> None:
    run, out = hf_runs["llama"], tmp_path / "out"
    summary = _convert(prefect_env, run / "ckpt", out, "--dtype", "bf16", "--keep-fp32", "norm")
    assert any("kept in float32" in n for n in summary["notes"])
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert manifest["options"]["keep_fp32"] == ["norm"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert {k for k, d in dtypes.items() if d == "F32"} == {k for k in dtypes if "norm" in k}
    assert {d for k, d in dtypes.items() if "norm" not in k} == {"BF16"}

    # The reference: the live weights, every one but the norms rounded to bf16 (as the
    # conversion rounds the fp32 masters, which are the live weights of an fp32 run). Loaded
    # in fp32 (transformers would cast the kept norms to a bf16 config dtype), the output
    # computes exactly what that model computes.
    weights = load_file(run / "live.safetensors")
    config = transformers.AutoConfig.from_pretrained(str(out))
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.load_state_dict(
        {k: v if "norm" in k else v.to(torch.bfloat16).float() for k, v in weights.items()}
    )
    live = load_file(run / "live-logits.safetensors")
    model, logits = _logits(out, live["input_ids"], dtype=torch.float32)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)
    with torch.no_grad():
        assert torch.equal(logits, reference(input_ids=live["input_ids"]).logits)
    # Against the live fp32 model, only the weights' bf16 rounding separates them.
    error = (logits - live["logits"]).abs().max().item()
    assert 0 < error < 4 * BF16_EPS * live["logits"].abs().max().item(), error


def test_gpt2_tied_bf16_logits_equal_the_live_model(
    hf_runs: dict[str, Path], prefect_env: dict[str, str], tmp_path: Path
) -> None:
    run, out = hf_runs["gpt2"], tmp_path / "out"
    live = load_file(run / "live-logits.safetensors")
    assert live["logits"].dtype == torch.bfloat16  # bf16 training: the engine computes in bf16
    summary = _convert(prefect_env, run / "ckpt", out, "--dtype", "bf16")
    assert summary["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    assert not summary["warnings"]  # the config says bf16 and tied: both agree
    # The alias is recorded, not written: transformers ties the head to the embedding.
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    model, logits = _logits(out, live["input_ids"])  # dtype 'auto': the config's bf16
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    # DeepSpeed's bf16 weights are the fp32 masters rounded to nearest, as zerosafe rounds
    # them: the same bytes, so the same logits, bit for bit.
    assert torch.equal(logits, live["logits"])


def test_gpt2_fp32_output_of_a_bf16_run(
    hf_runs: dict[str, Path], prefect_env: dict[str, str], tmp_path: Path
) -> None:
    run, out = hf_runs["gpt2"], tmp_path / "out"
    summary = _convert(prefect_env, run / "ckpt", out)
    (warning,) = summary["warnings"]
    assert "`dtype` is 'bfloat16' but the weights are written in float32" in warning
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"  # not edited
    live = load_file(run / "live-logits.safetensors")
    _, logits = _logits(out, live["input_ids"], dtype=torch.float32)
    # The live engine rounded every weight and activation to bf16; the fp32 masters did not.
    # A few bf16 roundings of the largest logit bound the difference.
    error = (logits - live["logits"].float()).abs().max().item()
    assert error < 4 * BF16_EPS * live["logits"].float().abs().max().item(), error
