"""Peak memory is set by the budget, not by the model or its largest tensor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from bench.forge import expected_fp32, forge_checkpoint
from tests.conftest import REPO

BUDGET = 48 * 2**20  # the smallest budget one task accepts is 40 MiB
BIG = (10061, 10061)  # 101 M elements: 405 MB in fp32, just over 8x the budget


@pytest.fixture(scope="module")
def big_tensor_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("big-tensor") / "ckpt"
    forge_checkpoint(
        dest,
        shapes=[("big.weight", BIG), ("small.bias", (37,))],
        stage=3,
        world_size=2,
        dtype="bf16",
        tied=False,
    )
    return dest


def _probe(kind: str, ckpt: Path, out: Path, options: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "memory_probe.py"), kind, str(ckpt), str(out), json.dumps(options)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_largest_tensor_8x_the_budget_stays_within_it(
    big_tensor_ckpt: Path, tmp_path: Path, direct: bool
) -> None:
    out = tmp_path / "out"
    result = _probe(
        "engine",
        big_tensor_ckpt,
        out,
        {"memory": BUDGET, "direct": direct, "max_shard_size": 10**9},
    )
    grew = result["peak_rss"] - result["baseline_rss"]
    tensor_bytes = BIG[0] * BIG[1] * 4
    print(
        f"\n{'direct' if direct else 'staged'}: largest tensor {tensor_bytes / 2**20:.0f} MiB "
        f"({tensor_bytes / BUDGET:.1f}x the {BUDGET / 2**20:.0f} MiB budget); baseline "
        f"{result['baseline_rss'] / 2**20:.0f} MiB, peak {result['peak_rss'] / 2**20:.0f} MiB, "
        f"grew {grew / 2**20:.1f} MiB in {result['seconds']:.1f} s"
    )
    assert tensor_bytes >= 8 * BUDGET
    assert grew <= BUDGET
    with safe_open(str(out / "model.safetensors"), framework="np") as f:
        got = f.get_slice("big.weight")
        for row in (0, 5003, BIG[0] - 1):
            np.testing.assert_array_equal(
                got[row : row + 1].reshape(-1), expected_fp32("big.weight", row * BIG[1], BIG[1])
            )
