"""An accelerate FSDP2 `SHARDED_STATE_DICT` save in the HF Trainer's layout, written once per
test session on CPU (gloo, 2 ranks) by `make_trainer_fsdp2.py`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def trainer_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run folder: `checkpoint-4/`, `live.safetensors`, `input-ids.safetensors`,
    `live-logits.safetensors` (`make_trainer_fsdp2.py` says what each holds)."""
    out = tmp_path_factory.mktemp("trainer-fsdp2")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "tests.formats.nested.make_trainer_fsdp2", str(out)],
        check=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    return out
