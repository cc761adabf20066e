"""`--to universal` on forged ZeRO checkpoints (bench/forge: DeepSpeed 0.19.8's layout with
known values), in the quick loop: every master lands in its param's `fp32.pt`, the moments
follow the same plan, and a param far larger than the chunk size streams through in bounded
memory. The real-DeepSpeed checks are in test_to_universal.py."""

from __future__ import annotations

import math
import os
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from zerosafe.errors import IntegrityError, UnsupportedCheckpointError
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import Storage
from zerosafe.training_state import convert_to_universal, plan_universal

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import forge as F  # noqa: E402

SHAPES = F.transformer_shapes(vocab=301, width=24, layers=2)  # odd sizes: params straddle ranks


def _forge(dest: Path, **kw: Any) -> F.ForgeInfo:
    args: dict[str, Any] = dict(
        shapes=SHAPES, stage=3, world_size=3, dtype="bf16", seed=5, threads=1, moments="zeros"
    )
    args.update(kw)
    return F.forge_checkpoint(dest, **args)


@pytest.mark.parametrize(
    "stage,extra",
    [(2, {}), (3, {"sub_group_numel": 700}), (1, {"dtype": "fp16", "groups": 1})],
    ids=["z2-bf16", "z3-bf16-subgroups", "z1-fp16"],
)
def test_masters_and_moments_land_in_their_files(
    tmp_path: Path, stage: int, extra: dict[str, Any]
) -> None:
    info = _forge(tmp_path / "ckpt", stage=stage, frozen=["layers.0.mlp.up_proj.weight"], **extra)
    out = tmp_path / "out"
    summary = convert_to_universal(
        str(tmp_path / "ckpt"), str(out), unit_bytes=4096, chunk_bytes=60
    )
    trained = [n for n in info.params if n not in info.frozen]
    assert summary.num_params == len(trained) and summary.units_run > 3
    zero = out / f"{info.tag}_universal" / "zero"
    for name in trained:
        shape = info.params[name]
        want = torch.from_numpy(F.expected_fp32(name, 0, math.prod(shape), seed=5).copy())
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            got = torch.load(zero / name / f"{state}.pt", weights_only=True)
            if stage < 3:
                assert set(got) == {"param", "cat_dim"} and got["cat_dim"] == 0
                got = got["param"]
                assert got.shape == shape
            else:
                assert got.shape == (math.prod(shape),)
            assert got.requires_grad == (state == "fp32"), (name, state)
            expected = want if state == "fp32" else torch.zeros_like(want)
            assert torch.equal(got.detach().reshape(-1), expected), (name, state)
        if stage < 3:
            assert torch.load(zero / name / "step.pt", weights_only=True).item() == 1
    # optimizer_state.pt names DeepSpeed's loss scaler: read it without DeepSpeed
    zf = TorchZipFile(Storage().open_source(str(zero / "optimizer_state.pt")))
    osd = zf.load()
    assert [g["lr"] for g in osd["param_groups"]] == [3e-4] * len(osd["param_groups"])
    assert "single_partition_of_fp32_groups" not in osd and "fp32_flat_groups" not in osd
    assert (out / "latest_universal").read_text() == f"{info.tag}_universal"


def test_a_param_larger_than_the_budget_streams(tmp_path: Path) -> None:
    """One 4M-element param (16 MB per state) through 64 KB chunks: Python allocates a few
    chunks at a time, never the param."""
    shapes = [("embed.weight", (4096, 1024)), ("norm.weight", (1024,))]
    _forge(tmp_path / "ckpt", shapes=shapes, stage=3, world_size=2, tied=False, groups=1)
    plan_universal(Storage(), str(tmp_path / "ckpt"), tag=None)  # warm imports and caches
    tracemalloc.start()
    try:
        convert_to_universal(str(tmp_path / "ckpt"), str(tmp_path / "out"), chunk_bytes=64 << 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"peak {peak} bytes of Python allocations"
    got = torch.load(
        tmp_path / "out" / "global_step1_universal" / "zero" / "embed.weight" / "fp32.pt",
        weights_only=True,
    )
    want = F.expected_fp32("embed.weight", 0, 4096 * 1024, seed=5)
    assert np.array_equal(got.detach().numpy(), want)


def test_other_optimizers_are_refused_in_one_line(tmp_path: Path) -> None:
    """Muon's state is not Adam's: refused at inspect, naming it, before anything is written."""
    _forge(tmp_path / "ckpt", stage=2, ds_config={"optimizer": {"type": "Muon"}})
    with pytest.raises(UnsupportedCheckpointError, match=r"`--to universal` of optimizer Muon"):
        convert_to_universal(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_corrupt_moment_in_the_checkpoint_is_caught(tmp_path: Path) -> None:
    """Every source record read is checked against its zip CRC-32: one flipped bit in a rank's
    `exp_avg_sq` fails the run before anything is published."""
    info = _forge(tmp_path / "ckpt", stage=2)
    optim = sorted((tmp_path / "ckpt" / info.tag).glob("*rank_1_*optim_states.pt"))[0]
    zf = TorchZipFile(Storage().open_source(str(optim)))
    moment = zf.load()["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg_sq"]
    at = zf.tensor_offset(moment) + 13
    good, stat = optim.read_bytes(), optim.stat()
    raw = bytearray(good)
    raw[at] ^= 0x10
    optim.write_bytes(bytes(raw))
    os.utime(optim, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # one job: the same size and mtime
    with pytest.raises(IntegrityError, match="do not match their recorded CRC-32.*dropped"):
        convert_to_universal(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "latest_universal").exists()
    assert not (tmp_path / "out" / "zerosafe-universal-complete.json").exists()
    # a good copy with the same size and mtime (`cp -p`) converts: no unit kept what it read
    optim.write_bytes(good)
    os.utime(optim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    summary = convert_to_universal(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert summary.status == "converted" and summary.units_kept == 0
