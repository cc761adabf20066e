"""`zerosafe inspect --simulate`: a plan from shapes alone equals the plan of a real checkpoint.

The forge writes checkpoints in DeepSpeed's own layout (tests/bench/test_forge.py checks them
against DeepSpeed's converter), so a simulated plan that matches the plan zerosafe builds from
a forged checkpoint of the same shapes lays the model out as DeepSpeed does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import forge as F  # noqa: E402
from zerosafe.config import ConvertOptions  # noqa: E402
from zerosafe.errors import ConfigError  # noqa: E402
from zerosafe.formats.deepspeed.checkpoint import build_plan, open_zero_checkpoint  # noqa: E402
from zerosafe.formats.deepspeed.simulate import (  # noqa: E402
    load_spec,
    predict_seconds,
    simulate_plan,
    simulation_report,
)
from zerosafe.io.storage import Storage  # noqa: E402

SHAPES = F.transformer_shapes(vocab=1001, width=64, layers=3, tied=True)


def _spec(path: Path, **checkpoint: object) -> Path:
    path.write_text(
        json.dumps(
            {
                "name": "small",
                "params": [[n, list(s)] for n, s in SHAPES],
                "tied": {"lm_head.weight": "embed.weight"},
                "checkpoint": {"zero_stage": 3, "train_dtype": "bf16", **checkpoint},
            }
        )
    )
    return path


@pytest.mark.parametrize("world_size,sub_group", [(5, 20_000), (8, 1_000_000_000)])
@pytest.mark.parametrize("direct", [True, False])
def test_simulated_plan_equals_plan_of_forged_checkpoint(
    tmp_path: Path, world_size: int, sub_group: int, direct: bool
) -> None:
    F.forge_checkpoint(
        tmp_path / "ckpt", shapes=SHAPES, stage=3, world_size=world_size, dtype="bf16",
        tied=True, buffers=[], sub_group_numel=sub_group, threads=1,
    )  # fmt: skip
    options = ConvertOptions(
        dtype="bf16", max_shard_size=60_000, direct=direct, extract_part_size=2**20
    )
    real = build_plan(open_zero_checkpoint(Storage(), str(tmp_path / "ckpt")), options)
    spec = load_spec(
        str(_spec(tmp_path / "s.json", world_size=world_size, sub_group_size=sub_group))
    )
    _, sim = simulate_plan(spec, options)

    assert [(t.name, t.shape, t.shard, t.out_dtype) for t in sim.tensors] == [
        (t.name, t.shape, t.shard, t.out_dtype) for t in real.tensors
    ]
    assert [(s.file_name, s.num_tensors, s.data_bytes) for s in sim.shards] == [
        (s.file_name, s.num_tensors, s.data_bytes) for s in real.shards
    ]
    for column in ("tensor", "slot", "src_offset", "numel", "dst_offset"):
        assert np.array_equal(getattr(sim.fragments, column), getattr(real.fragments, column))
    assert [(s.rank, s.kind, s.numel) for s in sim.slots] == [
        (s.rank, s.kind, s.numel) for s in real.slots
    ]
    assert [(p.rank, p.pieces) for p in sim.parts] == [(p.rank, p.pieces) for p in real.parts]
    assert sim.aliases == real.aliases == {"lm_head.weight": "embed.weight"}
    assert sim.fp32_bytes == real.fp32_bytes


def test_prediction_model(tmp_path: Path) -> None:
    spec = load_spec(str(_spec(tmp_path / "s.json", world_size=4)))
    options = ConvertOptions(dtype="bf16", max_shard_size=60_000, direct=True)
    _, plan = simulate_plan(spec, options)
    moved = sum(plan.shard_source_bytes(i) + 2 * s.data_bytes for i, s in enumerate(plan.shards))
    # one slot, storage the limit: every byte at the bandwidth
    assert predict_seconds(plan, options, workers=1, bandwidth=1e6, task_rate=1e12) == (
        pytest.approx(moved / 1e6)
    )
    # more workers never slow it down; a per-task cap binds when storage is fast
    times = [
        predict_seconds(plan, options, workers=w, bandwidth=1e6, task_rate=1e5) for w in (1, 2, 8)
    ]
    assert times[0] + 1e-6 >= times[1] and times[1] + 1e-6 >= times[2]
    report = simulation_report(spec, plan, options, workers=[1, 2], bandwidths=[1e6])
    assert report["tasks"]["merge_source_bytes"]["count"] == len(plan.shards)
    assert len(report["predictions"]) == 2


def test_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="zero_stage"):
        load_spec(str(_spec(tmp_path / "a.json", world_size=4, zero_stage=2)))
    with pytest.raises(ConfigError, match="world_size"):
        load_spec(str(_spec(tmp_path / "b.json")))


def test_cli_simulate(tmp_path: Path) -> None:
    spec = _spec(tmp_path / "s.json", world_size=4)
    run = [sys.executable, "-m", "zerosafe_app.cli", "inspect"]
    proc = subprocess.run(
        [*run, "--simulate", str(spec), "--world-size", "6", "--dtype", "bf16", "--json",
         "--workers", "1,3", "--bandwidth", "1GB"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["world_size"] == 6 and [p["workers"] for p in report["predictions"]] == [1, 3]
    text = subprocess.run(
        [*run, "--simulate", str(REPO / "conf" / "simulate-80b.yaml"), "--dtype", "bf16"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert text.returncode == 0, text.stderr
    assert "80.8B params" in text.stdout and "merge" in text.stdout
    both = subprocess.run(
        [*run, str(tmp_path), "--simulate", str(spec)], capture_output=True, text=True, cwd=REPO
    )
    assert both.returncode == 2 and "not both" in both.stderr
