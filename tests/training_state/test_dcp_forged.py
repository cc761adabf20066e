"""`--to dcp` on forged ZeRO checkpoints (bench/forge: DeepSpeed 0.19.8's layout with known
values), in the quick loop: a param far larger than the chunk size streams through in bounded
memory and reads back right through torch's own DCP reader; what is not converted is refused
in one line naming `--to dcp`; a corrupt source fails the run before `.metadata` exists. The
real-DeepSpeed and FSDP2 checks are in test_to_dcp.py."""

from __future__ import annotations

import os
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from zerosafe.errors import IntegrityError, UnsupportedCheckpointError
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import Storage
from zerosafe.training_state.dcp import convert_to_dcp
from zerosafe.training_state.dcp_plan import plan_dcp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import forge as F  # noqa: E402


def _forge(dest: Path, **kw: Any) -> F.ForgeInfo:
    args: dict[str, Any] = dict(
        shapes=F.transformer_shapes(vocab=301, width=24, layers=2), stage=3, world_size=3,
        dtype="bf16", seed=5, threads=1, moments="zeros",
    )  # fmt: skip
    args.update(kw)
    return F.forge_checkpoint(dest, **args)


def test_a_param_larger_than_the_budget_streams(tmp_path: Path) -> None:
    """One 4M-element param (16 MB per state) through 64 KB chunks: Python allocates a few
    chunks at a time, never the param; torch's DCP reader reads every state back."""
    shapes = [("embed.weight", (4096, 1024)), ("norm.weight", (1024,))]
    _forge(tmp_path / "ckpt", shapes=shapes, stage=3, world_size=2, tied=False, groups=1)
    plan_dcp(Storage(), str(tmp_path / "ckpt"), tag=None)  # warm imports and caches
    tracemalloc.start()
    try:
        summary = convert_to_dcp(
            str(tmp_path / "ckpt"), str(tmp_path / "out"), chunk_bytes=64 << 10
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"peak {peak} bytes of Python allocations"
    assert summary.num_params == 2 and summary.source_records_checked > 0
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "whole.pt"))
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    want = F.expected_fp32("embed.weight", 0, 4096 * 1024, seed=5).reshape(4096, 1024)
    assert np.array_equal(state["model"]["embed.weight"].numpy(), want)
    embed = state["optim"]["state"]["embed.weight"]
    assert embed["exp_avg"].shape == (4096, 1024) and not embed["exp_avg"].any()
    assert embed["step"].dtype == torch.float32 and embed["step"].shape == ()
    assert state["optim"]["param_groups"][0]["params"] == ["embed.weight", "norm.weight"]


def test_other_optimizers_are_refused_in_one_line(tmp_path: Path) -> None:
    _forge(tmp_path / "ckpt", stage=2, ds_config={"optimizer": {"type": "Muon"}})
    with pytest.raises(UnsupportedCheckpointError, match=r"`--to dcp` of optimizer Muon"):
        convert_to_dcp(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_corrupt_moment_in_the_checkpoint_is_caught(tmp_path: Path) -> None:
    """One flipped bit in a rank's `exp_avg_sq` fails the run: no `.metadata`, no marker."""
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
        convert_to_dcp(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert not (tmp_path / "out" / ".metadata").exists()
    assert not (tmp_path / "out" / "zerosafe-dcp-complete.json").exists()
    # a good copy with the same size and mtime (`cp -p`) converts: no unit kept what it read
    optim.write_bytes(good)
    os.utime(optim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    summary = convert_to_dcp(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert summary.status == "converted" and summary.units_kept == 0
