"""Real DeepSpeed ZeRO checkpoints for tests, and DeepSpeed's own converter as an oracle.

Everything that imports DeepSpeed runs in a subprocess (`DS_ACCELERATOR=cpu`), so a test
process never imports it.

    SPECS                                   name -> spec (the keys of `train_zero.py`, plus `world_size`)
    PIPE_SPECS                              name -> spec of `train_pipe.py` (PipelineModule, pipeline parallel)
    MOE_SPECS                               name -> spec of `train_moe.py` (DeepSpeed-MoE, AutoEP)
    train_checkpoint(spec, dest)            train with torchrun; returns the checkpoint folder,
                                            live weights at dest/"live.safetensors"
                                            (`script=PIPE_SCRIPT` for PIPE_SPECS, `MOE_SCRIPT` for
                                            MOE_SPECS)
    deepspeed_fp32_state_dict(ckpt, file)   run `get_fp32_state_dict_from_zero_checkpoint`,
                                            save its state dict to `file`; returns aliases / error
    ds_to_universal(tag_dir, out_dir)       run DeepSpeed's `ds_to_universal.py` (a universal
                                            checkpoint of the tag; `latest_universal` beside it)
    spec_key(spec[, script])                hash of the spec and of the training script (cache key)

fp16 on CPU: DeepSpeed's CPU accelerator reports fp16 as unsupported unless oneDNN has native
fp16 kernels (AVX512-FP16/AMX), and `deepspeed.initialize` then refuses fp16 configs. torch
computes fp16 on any CPU, so the launcher below answers that capability query with True before
running `train_zero.py`; nothing else of DeepSpeed is changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = [
    "HF_SCRIPT",
    "MOE_SCRIPT",
    "MOE_SPECS",
    "PIPE_SCRIPT",
    "PIPE_SPECS",
    "RESUME_SCRIPT",
    "SPECS",
    "TRAIN_SCRIPT",
    "deepspeed_fp32_state_dict",
    "ds_to_universal",
    "ds_to_universal_many",
    "resume_universal",
    "spec_key",
    "train_checkpoint",
]

TRAIN_SCRIPT = Path(__file__).with_name("train_zero.py")
HF_SCRIPT = Path(__file__).with_name("train_hf.py")
PIPE_SCRIPT = Path(__file__).with_name("train_pipe.py")
MOE_SCRIPT = Path(__file__).with_name("train_moe.py")
RESUME_SCRIPT = Path(__file__).with_name("resume_universal.py")
LIVE_NAME = "live.safetensors"
CKPT_NAME = "ckpt"
_FORMAT = "deepspeed_gen/1"  # bump when the layout of what train_checkpoint writes changes

# About 15 checkpoints, combining features; each trains in 10-35 s on a 2-core CPU machine.
# Dims are odd on purpose so ZeRO's flat partitions need padding and params straddle ranks.
SPECS: dict[str, dict[str, Any]] = {
    # ZeRO-1 + frozen params: DeepSpeed's converter silently drops the frozen ones.
    "z1-bf16-ws2-frozen-groups": {
        "world_size": 2, "stage": 1, "precision": "bf16", "frozen": True, "groups": 2, "steps": 2,
    },
    # bf16 + ZeRO-1 + fp32 grad accumulation -> BF16_Optimizer; DeepSpeed's converter refuses it.
    "z1-bf16opt-ws2-tied-frozen": {
        "world_size": 2, "stage": 1, "precision": "bf16", "grad_accum_dtype": "fp32",
        "tied": True, "frozen": True, "groups": 2, "steps": 2,
    },
    "z1-fp32-ws1-tied": {
        "world_size": 1, "stage": 1, "precision": "fp32", "tied": True, "steps": 2,
        "dims": [61, 24, 37], "layers": 3,
    },
    "z2-fp16-ws3-rr-frozen-groups": {
        "world_size": 3, "stage": 2, "precision": "fp16", "round_robin": True,
        "frozen": True, "groups": 2, "steps": 3,
    },
    "z2-bf16-ws4-tied-groups": {
        "world_size": 4, "stage": 2, "precision": "bf16", "tied": True, "groups": 2, "steps": 2,
        "dims": [53, 28, 45],
    },
    "z3-fp32-ws3-subgroups-tied-frozen": {
        "world_size": 3, "stage": 3, "precision": "fp32", "tied": True, "frozen": True,
        "sub_group_size": 500, "steps": 2,
    },
    "z3-fp16-ws2-groups-tied-persist": {
        "world_size": 2, "stage": 3, "precision": "fp16", "tied": True, "groups": 2,
        "persistence_threshold": 100, "steps": 3,
    },
    # `checkpoint: {checkpoint_serialization: false}`: every file in torch's legacy format.
    "z2-bf16-ws2-legacy-tied-frozen": {
        "world_size": 2, "stage": 2, "precision": "bf16", "legacy_files": True, "tied": True,
        "frozen": True, "steps": 2,
    },
    "z3-bf16-ws4-frozen-groups-subgroups": {
        "world_size": 4, "stage": 3, "precision": "bf16", "frozen": True, "groups": 2,
        "sub_group_size": 1000, "steps": 2, "dims": [71, 36, 59],
    },
    # Issue 14 layouts. bf16 masters with bf16 moments run without offload; bf16 masters with
    # fp32 moments, and fp16 masters always, need offload_optimizer cpu + DeepSpeedCPUAdam
    # (its C++ op is JIT-built once per machine, minutes on 2 cores).
    "z1-bf16master-ws2-zerosize-groups": {
        "world_size": 2, "stage": 1, "precision": "bf16", "master": "bf16",
        "bf16_optimizer_states": True, "zero_size": True, "groups": 2, "steps": 2,
    },
    "z2-fp16master-offload-ws2-zerosize": {
        "world_size": 2, "stage": 2, "precision": "fp16", "master": "fp16", "offload": "cpu",
        "cpu_adam": True, "zero_size": True, "steps": 2,
    },
    "z3-bf16master-offload-ws2-zerosize-tied": {
        "world_size": 2, "stage": 3, "precision": "bf16", "master": "bf16", "offload": "cpu",
        "cpu_adam": True, "zero_size": True, "tied": True, "sub_group_size": 2000, "steps": 2,
    },
    "z2-fp32-offload-ws3-frozen": {
        "world_size": 3, "stage": 2, "precision": "fp32", "offload": "cpu", "frozen": True,
        "steps": 2,
    },
    "z1-muon-bf16-ws2-groups": {
        "world_size": 2, "stage": 1, "precision": "bf16", "optimizer": "muon", "groups": 2,
        "steps": 2,
    },
    "z2-muon-fp32-ws2-frozen": {
        "world_size": 2, "stage": 2, "precision": "fp32", "optimizer": "muon", "frozen": True,
        "steps": 2,
    },
    "z3-muon-bf16-ws2-subgroups-tied": {
        "world_size": 2, "stage": 3, "precision": "bf16", "optimizer": "muon", "tied": True,
        "sub_group_size": 2000, "steps": 2,
    },
    # Issue 25 (`--to universal`): world size 4, resumed at 2 and 3 by resume_universal.py.
    "uc-z1-bf16-ws4-tied-frozen-groups": {
        "world_size": 4, "stage": 1, "precision": "bf16", "tied": True, "frozen": True,
        "groups": 2, "steps": 2, "dims": [53, 28, 45],
    },
    # ZeRO-Offload: DeepSpeedCPUAdam (its op is JIT-built once per machine).
    "uc-z2-fp32-ws4-cpuadam": {
        "world_size": 4, "stage": 2, "precision": "fp32", "offload": "cpu", "cpu_adam": True,
        "steps": 2, "dims": [53, 28, 45],
    },
    # bf16 + ZeRO-1 + fp32 grad accumulation: BF16_Optimizer.
    "uc-z1-bf16opt-ws4-tied-frozen": {
        "world_size": 4, "stage": 1, "precision": "bf16", "grad_accum_dtype": "fp32",
        "tied": True, "frozen": True, "steps": 2, "dims": [53, 28, 45],
    },
    "uc-z3-bf16-ws4-tied-frozen-subgroups": {
        "world_size": 4, "stage": 3, "precision": "bf16", "tied": True, "frozen": True,
        "sub_group_size": 1000, "steps": 2, "dims": [53, 28, 45],
    },
}  # fmt: skip

# Pipeline parallelism (`train_pipe.py`): a PipelineModule of 7 layers (embedding, a function,
# 3 blocks, a norm, the LM head) cut into `pipe` stages, ZeRO-1. Each trains in 10-20 s.
PIPE_SPECS: dict[str, dict[str, Any]] = {
    # The tied module is the head too: a layer file at both ends, a buffer under tied_modules.
    "pp2-fp32-tied": {
        "world_size": 2, "pipe": 2, "stage": 1, "precision": "fp32", "tied": True,
        "tied_head": "module",
    },
    "pp2-bf16-tied-frozen": {
        "world_size": 2, "pipe": 2, "stage": 1, "precision": "bf16", "tied": True, "frozen": True,
    },
    # pp=2 x dp=2: each stage's masters partitioned over its two data-parallel ranks.
    "pp2-dp2-bf16-tied": {
        "world_size": 4, "pipe": 2, "stage": 1, "precision": "bf16", "tied": True,
        "dims": [53, 28, 45],
    },
    # bf16 + fp32 grad accumulation: BF16_Optimizer on every stage; an untied LM head.
    "pp2-bf16opt-frozen": {
        "world_size": 2, "pipe": 2, "stage": 1, "precision": "bf16", "grad_accum_dtype": "fp32",
        "frozen": True,
    },
    # Three stages: the tied embedding lives on stages 0 and 2, not on the middle one.
    "pp3-bf16-tied-frozen": {
        "world_size": 3, "pipe": 3, "stage": 1, "precision": "bf16", "tied": True, "frozen": True,
        "layers": 4,
    },
}  # fmt: skip

# Issue 14, item 5: mixture-of-experts, trained by train_moe.py. Native DeepSpeed-MoE at ZeRO-1/2
# (DeepSpeed refuses it at ZeRO-3), AutoEP (a tiny transformers Mixtral) at ZeRO-1/2 and
# ZeRO-3 ("partition-native"). Experts per layer, expert-parallel sizes and the
# expert-data-parallel topology vary; each trains in 10-20 s on a 2-core CPU machine.
# round_robin_gradients is left out: DeepSpeed's own fp32 view of a param
# (`safe_get_full_fp32_param`, which train_moe.py's live masters rely on) is wrong with it
# (`_link_all_hp_params` ignores the round-robin order when no param is padded).
MOE_SPECS: dict[str, dict[str, Any]] = {
    # Two MoE layers of expert-parallel sizes 2 and 1: two expert groups partitioned over 1
    # and 2 ranks, which DeepSpeed may order differently on each rank.
    "moe-z2-bf16-ws2-ep2-and-ep1": {
        "world_size": 2, "stage": 2, "precision": "bf16", "ep_sizes": [2, 1], "num_experts": 2,
    },
    "moe-z1-fp32-ws2-ep2-groups-frozen": {
        "world_size": 2, "stage": 1, "precision": "fp32", "ep_sizes": [2], "num_experts": 4,
        "groups": 2, "frozen_expert": True,
    },
    # use_data_before_expert_parallelism: expert-data-parallel groups [0, 1] and [2, 3]
    # instead of [0, 2] and [1, 3].
    "moe-z2-fp16-ws4-ep2-databefore-frozen": {
        "world_size": 4, "stage": 2, "precision": "fp16", "ep_sizes": [2], "num_experts": 4,
        "data_before_expert": True, "frozen_expert": True,
    },
    "moe-z1-bf16opt-ws2-ep2": {
        "world_size": 2, "stage": 1, "precision": "bf16", "grad_accum_dtype": "fp32",
        "ep_sizes": [2], "num_experts": 2,
    },
    "moe-z2-bf16-ws4-ep4-and-ep2-groups": {
        "world_size": 4, "stage": 2, "precision": "bf16", "ep_sizes": [4, 2], "num_experts": 4,
        "groups": 2,
    },
    "autoep-z3-bf16-ws2-ep2": {
        "world_size": 2, "stage": 3, "precision": "bf16", "autoep": True, "ep_size": 2,
        "num_experts": 4,
    },
    "autoep-z3-fp32-ws4-ep2": {
        "world_size": 4, "stage": 3, "precision": "fp32", "autoep": True, "ep_size": 2,
        "num_experts": 4,
    },
    "autoep-z2-bf16-ws2-ep2": {
        "world_size": 2, "stage": 2, "precision": "bf16", "autoep": True, "ep_size": 2,
        "num_experts": 4,
    },
    "autoep-z1-fp16-ws4-ep2-databefore": {
        "world_size": 4, "stage": 1, "precision": "fp16", "autoep": True, "ep_size": 2,
        "num_experts": 4, "data_before_expert": True,
    },
}  # fmt: skip

_LAUNCHER = """\
import runpy, sys
import torch
from deepspeed.accelerator import cpu_accelerator as _cpu
_cpu.CPU_Accelerator.is_fp16_supported = lambda self: True
_cpu.CPU_Accelerator.supported_dtypes = lambda self: [torch.float32, torch.bfloat16, torch.float16]
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""

_ORACLE = """\
import json, sys, traceback
ckpt, out_file, info_file = sys.argv[1:4]
info = {"error": None, "aliases": {}, "names": [], "dtypes": {}}
try:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
except Exception as e:
    info["error"] = f"{type(e).__name__}: {e}"
    info["traceback"] = traceback.format_exc()
else:
    from safetensors.torch import save_file
    seen = {}
    unique = {}
    for name, t in sd.items():
        info["names"].append(name)
        info["dtypes"][name] = str(t.dtype).replace("torch.", "")
        if id(t) in seen:  # DeepSpeed restores a tied alias as the target's tensor object
            info["aliases"][name] = seen[id(t)]
            continue
        seen[id(t)] = name
        unique[name] = t.detach().clone().contiguous()
    save_file(unique, out_file, metadata={"aliases": json.dumps(info["aliases"])})
with open(info_file, "w") as f:
    json.dump(info, f, indent=1)
"""


def spec_key(spec: dict[str, Any], script: Path = TRAIN_SCRIPT) -> str:
    """A stable key for a spec trained by the current `script` (for caches)."""
    h = hashlib.sha256()
    h.update(_FORMAT.encode())
    h.update(json.dumps(spec, sort_keys=True).encode())
    h.update(Path(script).read_bytes())
    h.update(_LAUNCHER.encode())
    return h.hexdigest()[:20]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Muon's Newton-Schulz step is `torch.compile`d: compiling C++ kernels takes minutes on CPU
    # machines; TORCHDYNAMO_DISABLE runs it eagerly, with the same results.
    env.update(
        DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCHDYNAMO_DISABLE="1"
    )
    return env


def _tail(path: Path, chars: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    lines = [ln for ln in text.splitlines() if "[WARNING] [real_accelerator.py" not in ln]
    return "\n".join(lines)[-chars:]


def train_checkpoint(
    spec: dict[str, Any],
    dest: Path,
    *,
    attempts: int = 3,
    timeout: float = 600,
    script: Path = TRAIN_SCRIPT,
) -> Path:
    """Train `spec` with real DeepSpeed on CPU ranks; returns the checkpoint folder.

    Writes dest/"ckpt" (the checkpoint), dest/"live.safetensors" (the live weights and
    buffers at the end of training; `script` is `TRAIN_SCRIPT`, `HF_SCRIPT`, which trains a
    transformers model and saves its config and tokenizer as the HF Trainer does,
    `PIPE_SCRIPT` (a PipelineModule), or `MOE_SCRIPT`, whose live file holds the fp32 masters
    of every expert),
    dest/"spec.json" and dest/"train.log". gloo with more
    ranks than cores sometimes aborts at random, so a failed run is retried from scratch.

    Raises:
        RuntimeError: With the log's tail, when every attempt failed.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    spec_file = dest / "spec.json"
    spec_file.write_text(json.dumps(spec, sort_keys=True, indent=1))
    ckpt, live, log = dest / CKPT_NAME, dest / LIVE_NAME, dest / "train.log"
    world = int(spec.get("world_size", 1))
    failures = []
    for attempt in range(1, attempts + 1):
        shutil.rmtree(ckpt, ignore_errors=True)
        live.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc_per_node", str(world),
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
            "--no-python", sys.executable, "-c", _LAUNCHER,
            str(script), str(spec_file), str(ckpt), str(live),
        ]  # fmt: skip
        with open(log, "w") as f:
            try:
                rc = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=dest, timeout=timeout
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        # The HF Trainer (`lora` specs of HF_SCRIPT) saves into ckpt/checkpoint-STEPS/.
        saved = (ckpt / "latest").is_file() or any(ckpt.glob("checkpoint-*/latest"))
        if rc == 0 and live.is_file() and saved:
            return ckpt
        failures.append(f"attempt {attempt}: exit {rc}")
        shutil.copyfile(log, dest / f"train.attempt{attempt}.log")
        time.sleep(1)
    raise RuntimeError(
        f"training {spec} failed {attempts} times ({'; '.join(failures)}); log tail:\n{_tail(log)}"
    )


def deepspeed_fp32_state_dict(
    ckpt_dir: Path, out_file: Path, *, timeout: float = 600
) -> dict[str, Any]:
    """Run DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` on `ckpt_dir` in a subprocess.

    The state dict goes to `out_file` (safetensors; a tied alias is stored once, under its
    target). Returns (and writes next to `out_file` as .json) a dict with
    `error` (None, or the exception DeepSpeed raised, as text), `aliases` (alias -> target),
    `names` (every name DeepSpeed returned, aliases included), `dtypes` and `file`
    (`out_file` as a string, or None when DeepSpeed raised).

    Raises:
        RuntimeError: When the subprocess itself failed (not when DeepSpeed raised).
    """
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    info_file = out_file.with_suffix(".json")
    out_file.unlink(missing_ok=True)
    info_file.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", _ORACLE, str(ckpt_dir), str(out_file), str(info_file)],
        capture_output=True, text=True, env=_env(), timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0 or not info_file.is_file():
        raise RuntimeError(
            f"DeepSpeed's converter subprocess failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    info: dict[str, Any] = json.loads(info_file.read_text())
    info["file"] = None if info["error"] else str(out_file)
    info["log"] = proc.stdout[-3000:]
    return info


def ds_to_universal(tag_dir: Path, out_dir: Path, *, timeout: float = 600) -> Path:
    """Run DeepSpeed's `ds_to_universal.py` on the tag folder `tag_dir` in a subprocess.

    It writes `out_dir/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt`, copies the tag's model
    states into `out_dir` and writes `latest_universal` (naming `out_dir`) into its parent.
    `--inject_missing_state` supplies the `universal_checkpoint_info` that only Megatron-style
    clients save; one worker each, in process (no process pool on a 2-core machine).

    Raises:
        RuntimeError: With the output's tail, when the converter failed.
    """
    out_dir = Path(out_dir)
    proc = subprocess.run(
        [
            sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
            "--input_folder", str(tag_dir), "--output_folder", str(out_dir),
            "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1",
        ],
        capture_output=True, text=True, env=_env(), timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0 or not (out_dir / "zero").is_dir():
        raise RuntimeError(
            f"ds_to_universal.py failed on {tag_dir} (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return out_dir


_DS_TO_UNIVERSAL_MANY = """\
import argparse, json, sys
from deepspeed.checkpoint.ds_to_universal import main
for tag_dir, out_dir in json.loads(sys.argv[1]):
    main(argparse.Namespace(
        input_folder=tag_dir, output_folder=out_dir, num_extract_workers=1, num_merge_workers=1,
        keep_temp_folder=False, strict=True, inject_missing_state=True,
    ))
"""


def ds_to_universal_many(pairs: list[tuple[Path, Path]], *, timeout: float = 900) -> None:
    """`ds_to_universal` of each `(tag_dir, out_dir)`, all in one subprocess (importing
    DeepSpeed costs more than converting a small checkpoint).

    Raises:
        RuntimeError: With the output's tail, when the converter failed.
    """
    proc = subprocess.run(
        [sys.executable, "-c", _DS_TO_UNIVERSAL_MANY, json.dumps([[str(a), str(b)] for a, b in pairs])],
        capture_output=True, text=True, env=_env(), timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0 or not all((Path(b) / "zero").is_dir() for _, b in pairs):
        raise RuntimeError(
            f"ds_to_universal.py failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )


def resume_universal(
    jobs: list[tuple[dict[str, Any], Path]],
    world_size: int,
    dest: Path,
    *,
    attempts: int = 3,
    timeout: float = 900,
) -> list[Path]:
    """Resume each `(spec, load_dir)` of `jobs` at `world_size` from its universal checkpoint
    (`load_dir` holds `latest_universal`) with `resume_universal.py`, all in one torchrun;
    returns, per job, the folder of its `rank<r>.safetensors` records (partitions as loaded
    and after the steps, losses in the metadata). gloo with more ranks than cores sometimes
    aborts: retried from scratch.

    Raises:
        RuntimeError: With the log's tail, when every attempt failed.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    outs = [dest / f"job{i}" for i in range(len(jobs))]
    jobs_file = dest / "jobs.json"
    jobs_file.write_text(
        json.dumps(
            [
                {"spec": spec, "load_dir": str(load_dir), "out_dir": str(out)}
                for (spec, load_dir), out in zip(jobs, outs, strict=True)
            ],
            indent=1,
        )
    )
    log = dest / "resume.log"
    failures = []
    for attempt in range(1, attempts + 1):
        for out in outs:
            shutil.rmtree(out, ignore_errors=True)
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc_per_node", str(world_size),
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
            "--no-python", sys.executable, "-c", _LAUNCHER,
            str(RESUME_SCRIPT), str(jobs_file),
        ]  # fmt: skip
        with open(log, "w") as f:
            try:
                rc = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=dest, timeout=timeout
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc == 0 and all(
            (o / f"rank{r}.safetensors").is_file() for o in outs for r in range(world_size)
        ):
            return outs
        failures.append(f"attempt {attempt}: exit {rc}")
        shutil.copyfile(log, dest / f"resume.attempt{attempt}.log")
        time.sleep(1)
    raise RuntimeError(
        f"resuming {len(jobs)} checkpoint(s) at world size {world_size} failed {attempts} "
        f"times ({'; '.join(failures)}); log tail:\n{_tail(log)}"
    )
