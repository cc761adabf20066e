"""Saves of torch's `HuggingFaceStorageWriter(save_distributed=True)` from an FSDP2 model,
written once per test session by torch itself (2 CPU ranks, gloo), with the live weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def hf_storage_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the saves (`make_hf_storage_checkpoint.py` says what is in it). Torch 2.13 on
    CPU writes them, so a failure to write fails the tests, saying why."""
    out = tmp_path_factory.mktemp("hf_storage")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "tests.formats.hf_storage.make_hf_storage_checkpoint", str(out)],
        check=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    status = json.loads((out / "status.json").read_text())["fsdp2"]
    if status != "ok":
        pytest.fail(f"torch could not write the HuggingFaceStorageWriter saves here: {status}")
    return out


@pytest.fixture(scope="session")
def hf_storage_live(hf_storage_root: Path) -> dict[str, torch.Tensor]:
    """The FSDP2 model's full fp32 state dict when it was saved."""
    return dict(torch.load(hf_storage_root / "live.pt"))


Save = Callable[[str], Path]
