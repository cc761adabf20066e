"""Real torch_checkpointing saves, written once per test session by the library's own
`CheckpointManager` on 2 CPU ranks (gloo), with the live weights beside them
(`make_tc_checkpoint.py` says what is in the folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def tc_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("torch_checkpointing")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "tests.formats.torch_checkpointing.make_tc_checkpoint", str(out)],
        check=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    return out


@pytest.fixture(scope="session")
def tc_save(tc_root: Path) -> Callable[[str], Path]:
    """`tc_save(layout)`: the `step_1/` save folder of a layout (`pt`: the default
    `<item>_R.pt` files; `st`: the model item as `model_R.safetensors`
    with `metadata.pkl`; `shard1`: FSDP2 with
    `Shard(1)` placements), failing the test,
    saying why, where torch_checkpointing could not write it (never skipping)."""

    def get(layout: str) -> Path:
        status = json.loads((tc_root / "status.json").read_text()).get(layout, "not generated")
        if status != "ok":
            pytest.fail(f"torch_checkpointing could not write the '{layout}' save here: {status}")
        return tc_root / layout / "step_1"

    return get
