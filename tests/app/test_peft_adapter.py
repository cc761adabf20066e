"""`zerosafe convert --adapter` on PEFT LoRA checkpoints the real HF `Trainer` saved under real
DeepSpeed (issue 26, PEFT adapters out), loaded with the real `PeftModel.from_pretrained`.

Two tiny trainings per session (`tests/deepspeed_gen/train_hf.py` with a `lora` spec: the
Trainer, 2 CPU ranks, saving `checkpoint-4/` itself, with DeepSpeed's
`exclude_frozen_parameters`, so no base weight is in it):
- Llama-style, fp32, ZeRO-3, LoRA on q/v/o and `lm_head` as a module to save;
- GPT-2-style (tied embeddings, Conv1D: `fan_in_fan_out`), fp32, ZeRO-2, LoRA on
  `c_attn`/`c_proj` with a `rank_pattern` and trained biases (`bias: lora_only`).
The references are what the live model gave at save time: `get_peft_model_state_dict` of its
gathered parameters (the adapter PEFT itself saves: names and values) and its logits.
ZEROSAFE_DS_CACHE=dir keeps the trainings between runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # test dependencies (the `test` extra): a missing one fails, never skips
from peft import PeftModel
from safetensors.torch import load_file

from tests.deepspeed_gen import HF_SCRIPT, train_checkpoint

pytestmark = pytest.mark.slow

SPECS = {
    "llama-z3": {
        "arch": "llama", "stage": 3, "precision": "fp32", "world_size": 2, "steps": 4,
        "lora": {
            "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
            "target_modules": ["q_proj", "v_proj", "o_proj"], "modules_to_save": ["lm_head"],
        },
    },
    "gpt2-z2": {
        "arch": "gpt2", "stage": 2, "precision": "fp32", "world_size": 2, "steps": 4,
        "lora": {
            "r": 3, "lora_alpha": 6, "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
            "target_modules": ["c_attn", "c_proj"], "fan_in_fan_out": True,
            "bias": "lora_only", "rank_pattern": {"mlp.c_proj": 2},
        },
    },
}  # fmt: skip


@pytest.fixture(scope="session")
def peft_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> training folder (`ckpt/checkpoint-4/`, `live.safetensors`: the live adapter,
    `live-logits.safetensors`, `base/`: the base model before training)."""
    cache = os.environ.get("ZEROSAFE_DS_CACHE")
    runs = {}
    for name, spec in SPECS.items():
        key = hashlib.sha256(json.dumps(spec).encode() + HF_SCRIPT.read_bytes()).hexdigest()[:16]
        dest = Path(cache) / f"peft-{name}-{key}" if cache else tmp_path_factory.mktemp(name)
        if not (dest / "live-logits.safetensors").is_file():
            shutil.rmtree(dest, ignore_errors=True)
            train_checkpoint(spec, dest, script=HF_SCRIPT)
        runs[name] = dest
    return runs


def _zerosafe(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip


def _convert(env: dict[str, str], ckpt: Path, out: Path, *args: str) -> dict[str, Any]:
    proc = _zerosafe(env, "convert", "--json", str(ckpt), str(out), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary: dict[str, Any] = json.loads(proc.stdout)
    return summary


def _check_adapter(run: Path, out: Path, env: dict[str, str], *, ckpt: Path | None = None) -> None:
    """The output is the adapter PEFT saves from the live model, loads with
    `PeftModel.from_pretrained` onto the base model and computes the live model's logits, bit
    for bit; `verify` and `verify --against` pass."""
    ckpt = ckpt or run / "ckpt" / "checkpoint-4"
    live = load_file(run / "live.safetensors")
    got = load_file(out / "adapter_model.safetensors")
    assert sorted(got) == sorted(live)  # PEFT's names, no base-model tensor
    assert all(torch.equal(got[k], live[k]) for k in live)
    copied = (out / "adapter_config.json").read_bytes()
    assert copied == (ckpt / "adapter_config.json").read_bytes()
    assert not (out / "model.safetensors").exists()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(run / "base"))
    model = PeftModel.from_pretrained(base, str(out)).eval()
    reference = load_file(run / "live-logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"]).logits
    assert torch.equal(logits, reference["logits"])
    for args in (["verify", str(out)], ["verify", str(out), "--against", str(ckpt)]):
        proc = _zerosafe(env, *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert manifest["options"]["adapter"] is True
    assert [f["file"] for f in manifest["files"]] == ["adapter_model.safetensors"]


def test_zero3_lora_with_a_module_to_save_loads_with_peft(
    peft_runs: dict[str, Path], prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """The folder a user has (`checkpoint-4/`), through the flow as a user runs it."""
    run, out = peft_runs["llama-z3"], tmp_path / "out"
    summary = _convert(prefect_env, run / "ckpt" / "checkpoint-4", out, "--adapter")
    assert summary["status"] == "converted" and not summary["warnings"]
    assert summary["files"] == ["adapter_model.safetensors"]
    assert any("PEFT adapter" in n for n in summary["notes"])
    live = load_file(run / "live.safetensors")
    assert "base_model.model.lm_head.weight" in live  # the module to save, as PEFT names it
    _check_adapter(run, out, prefect_env)


def test_zero2_tied_gpt2_with_rank_pattern_and_trained_biases(
    peft_runs: dict[str, Path], local_env: dict[str, str], tmp_path: Path
) -> None:
    run, out = peft_runs["gpt2-z2"], tmp_path / "out"
    summary = _convert(local_env, run / "ckpt" / "checkpoint-4", out, "--adapter", "--via", "local")
    assert not summary["warnings"]
    # The frozen tied embedding (not saved: exclude_frozen_parameters) is left out, with a note.
    assert any("tied param 'base_model.model.lm_head.weight'" in n for n in summary["notes"])
    live = load_file(run / "live.safetensors")
    assert live["base_model.model.transformer.h.0.mlp.c_proj.lora_A.weight"].shape == (2, 96)
    assert "base_model.model.transformer.h.0.attn.c_attn.base_layer.bias" in live
    _check_adapter(run, out, local_env)


def test_without_adapter_the_checkpoint_is_named_as_a_peft_adapter(
    peft_runs: dict[str, Path], local_env: dict[str, str], tmp_path: Path
) -> None:
    summary = _convert(
        local_env, peft_runs["llama-z3"] / "ckpt" / "checkpoint-4", tmp_path / "out", "--via", "local"
    )  # fmt: skip
    assert any("holds a PEFT LoRA adapter" in w and "--adapter" in w for w in summary["warnings"])
    assert not (tmp_path / "out" / "adapter_config.json").exists()  # not beside a whole model


def test_a_lora_shape_the_config_does_not_imply_is_refused(
    peft_runs: dict[str, Path], local_env: dict[str, str], tmp_path: Path
) -> None:
    """A checkpoint whose LoRA matrices disagree with adapter_config.json (here the config
    says r=8 where the ranks saved r=4: what a rank's half of a row-split lora_A looks like
    to a converter) is refused with one line, and nothing is published."""
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(peft_runs["llama-z3"] / "ckpt" / "checkpoint-4", ckpt)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    out = tmp_path / "out"
    proc = _zerosafe(local_env, "convert", "--via", "local", "--adapter", str(ckpt), str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "lora_A.default.weight' has shape (4, 24), expected (8, ?)" in lines[0]
    )
    assert "one rank's slice" in lines[0]
    assert not (out / "adapter_model.safetensors").exists()
    assert not (out / "zerosafe-complete.json").exists()

    (ckpt / "adapter_config.json").unlink()
    proc = _zerosafe(local_env, "convert", "--via", "local", "--adapter", str(ckpt), str(out))
    assert proc.returncode == 2 and "adapter_config.json: missing" in proc.stderr, proc.stderr


def _copy_with_config(run: Path, dest: Path, **changes: Any) -> Path:
    """The run's `checkpoint-4/` copied to `dest`, its adapter_config.json changed."""
    ckpt = dest / "checkpoint-4"
    shutil.copytree(run / "ckpt" / "checkpoint-4", ckpt)
    config = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return ckpt


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        # the run adapted q/v/o: PeftModel.from_pretrained would load this config and silently
        # drop every v_proj matrix (other logits)
        ({"target_modules": ["q_proj", "o_proj"]}, r"self_attn\.v_proj' matches no"),
        # a module the model does not have
        ({"target_modules": ["q_proj", "v_proj", "o_proj", "qkv_proj"]}, r"'qkv_proj' matches no"),
        # layer 1's matrices are outside `layers_to_transform`
        ({"layers_to_transform": [0]}, r"layers\.1\.self_attn\.\w_proj' is in layer 1, outside"),
    ],
)
def test_target_modules_that_disagree_with_the_lora_tensors_are_refused(
    peft_runs: dict[str, Path],
    local_env: dict[str, str],
    tmp_path: Path,
    changes: dict[str, Any],
    refusal: str,
) -> None:
    """Issue 37 item 3: a config whose `target_modules` (with its `layers_to_transform`) does
    not name exactly the modules the LoRA tensors adapt is refused with one line, nothing
    published."""
    ckpt = _copy_with_config(peft_runs["llama-z3"], tmp_path, **changes)
    out = tmp_path / "out"
    proc = _zerosafe(local_env, "convert", "--via", "local", "--adapter", str(ckpt), str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(refusal, lines[0]), proc.stderr
    assert "adapter_config.json" in lines[0]
    assert not (out / "adapter_model.safetensors").exists()


def test_a_regex_target_with_exclude_modules_converts_and_loads(
    peft_runs: dict[str, Path], local_env: dict[str, str], tmp_path: Path
) -> None:
    """`target_modules` as a regex (PEFT full-matches it) and `exclude_modules` removing the
    projections the run did not adapt: the same modules as the run's list, so the adapter
    converts and PEFT loads it to the live logits."""
    run = peft_runs["llama-z3"]
    ckpt = _copy_with_config(
        run, tmp_path,
        target_modules=r".*\.layers\.\d+\.(self_attn|mlp)\.\w+_proj",
        exclude_modules=["k_proj", "gate_proj", "up_proj", "down_proj"],
    )  # fmt: skip
    out = tmp_path / "out"
    _convert(local_env, ckpt, out, "--adapter", "--via", "local")
    _check_adapter(run, out, local_env, ckpt=ckpt)
