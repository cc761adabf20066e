"""Real DCP checkpoints, written once per test session by torch itself (4 and 2 CPU ranks, gloo),
and torch's own consolidation of each (`dcp_to_torch_save`) as the oracle."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def dcp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the generated checkpoints (`make_dcp_checkpoint.py` says what is in it)."""
    out = tmp_path_factory.mktemp("dcp")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "tests.formats.dcp.make_dcp_checkpoint", str(out)],
        check=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    return out


def dcp_status(root: Path) -> dict[str, str]:
    return dict(json.loads((root / "status.json").read_text()))


@pytest.fixture(scope="session")
def dcp_checkpoint(dcp_root: Path) -> Callable[[str], Path]:
    """`dcp_checkpoint(name)`: the path of a generated checkpoint. Torch 2.13 on CPU writes
    every one of them (FSDP2's `fully_shard` included), so one it could not write fails the
    test, saying why, instead of skipping what would then look tested."""

    def get(name: str) -> Path:
        # a job may write two checkpoints
        job = {"safetensors": "flat", "app_two_models": "app"}.get(name, name)
        status = dcp_status(dcp_root).get(job, "not generated")
        if status != "ok":
            pytest.fail(f"torch could not write the '{name}' DCP checkpoint here: {status}")
        return dcp_root / name

    return get


def flatten(state: dict[str, object], prefix: str = "") -> dict[str, object]:
    """Nested state dict -> DCP's flattened keys (`model.emb.weight`)."""
    out: dict[str, object] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.fixture(scope="session")
def dcp_oracle(dcp_root: Path) -> Callable[[str], dict[str, object]]:
    """`dcp_oracle(name)`: torch's `dcp_to_torch_save` of a checkpoint, flattened."""
    cache: dict[str, dict[str, object]] = {}

    def get(name: str) -> dict[str, object]:
        if name not in cache:
            import torch
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            out = dcp_root / f"{name}.oracle.pt"
            dcp_to_torch_save(dcp_root / name, out)
            cache[name] = flatten(torch.load(out, weights_only=False))
        return cache[name]

    return get


def copy_checkpoint(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


@pytest.fixture(scope="session")
def olmo_core_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real OLMo-core checkpoint, written once per test session by OLMo-core's own
    `save_model_and_optim_state` (FSDP2 over 2 gloo ranks on the CPU): `step3/model_and_optim/`,
    `step3/config.json`, `step3/train/rank0.pt`, and `live.safetensors`, the live model's full
    state dict (`make_olmo_core_checkpoint.py` says more). A checkpoint OLMo-core could not
    write fails the test, saying why."""
    out = tmp_path_factory.mktemp("olmo_core")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "tests.formats.dcp.make_olmo_core_checkpoint", str(out)],
        check=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    status = json.loads((out / "status.json").read_text()).get("olmo_core", "not generated")
    if status != "ok":
        pytest.fail(f"OLMo-core could not write its checkpoint here: {status}")
    return out


@pytest.fixture(scope="session")
def bytecheckpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ByteCheckpoint checkpoint, written once per test session by ByteCheckpoint's own
    `bytecheckpoint.save` (FSDP2 over 2 gloo ranks on the CPU): `ckpt/global_step_3/` with
    `model/`, `optimizer/` and `extra_state/`, and `live.safetensors`, the live model's full
    state dict (`make_bytecheckpoint_checkpoint.py` says more). A checkpoint ByteCheckpoint
    could not write fails the test, saying why."""
    out = tmp_path_factory.mktemp("bytecheckpoint")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "tests.formats.dcp.make_bytecheckpoint_checkpoint", str(out)],
        check=True, cwd=REPO, env=env, timeout=600, capture_output=True,
    )  # fmt: skip
    status = json.loads((out / "status.json").read_text()).get("bytecheckpoint", "not generated")
    if status != "ok":
        pytest.fail(f"ByteCheckpoint could not write its checkpoint here: {status}")
    return out
