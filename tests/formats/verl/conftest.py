"""Real verl FSDP checkpoints, written once per test session by verl's own
`FSDPCheckpointManager` on 2 CPU ranks (gloo), with the live weights beside them and verl's own
`model_merger` output (`make_verl_checkpoint.py` says what is in the folder)."""

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
def verl_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verl")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "tests.formats.verl.make_verl_checkpoint", str(out)],
        check=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    return out


@pytest.fixture(scope="session")
def verl_run(verl_root: Path) -> Callable[[str], Path]:
    """`verl_run(name)`: the folder of a generated variant (`fsdp2`, `replicate`, `shard1`,
    `lora`, `quant`; `merger`, `lora-merger`: the folders whose `merged/` verl's merger wrote), failing the test, saying why, where verl could not write it (never skipping)."""

    def get(name: str) -> Path:
        status = json.loads((verl_root / "status.json").read_text()).get(name, "not generated")
        if status != "ok":
            pytest.fail(f"verl could not write the '{name}' checkpoint here: {status}")
        folder = {"fsdp2": "", "merger": "", "lora-merger": "lora"}.get(name, name)
        return verl_root / folder if folder else verl_root

    return get
