"""Resume real DeepSpeed training (CPU, gloo, 2 ranks, ZeRO-2 and ZeRO-3) from a checkpoint's
`.pt` files and from zerosafe siblings: the same losses and bit-identical weights afterwards,
and each rank's peak memory during `engine.load_checkpoint` both ways, in the same run.

Memory: RSS counts the pages of a memory-mapped sibling once touched, although they are clean
file pages the kernel can drop at any time; the anonymous part of RSS (RSS less file-backed
and shared pages) is what a load must really find in host RAM. Loading a `.pt` allocates the
whole file there; loading a sibling maps it, and DeepSpeed adopts the Adam moments without
touching them, so the anonymous peak stays near zero. That is asserted; RSS is printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.deepspeed_gen import _env, _free_port, _tail
from zerosafe_app.cli import main

SCRIPT = Path(__file__).with_name("resume_zero.py")
BUDGET = "40MiB"  # the smallest budget lazify accepts; each optimizer file is over twice it
MiB = 2**20


def _torchrun(args: list[str], log: Path, cwd: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        str(SCRIPT), *args,
    ]  # fmt: skip
    env = _env()
    env["PYTHONPATH"] = str(Path(__file__).parents[2])
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=300)
    assert rc.returncode == 0, f"{' '.join(args[:1])} failed (exit {rc.returncode}):\n{_tail(log)}"


def _resume(spec_file: Path, ckpt: Path, via: str, tmp: Path) -> dict[str, Any]:
    out = tmp / f"resume-{via}"
    out.mkdir()
    _torchrun(["resume", str(spec_file), str(ckpt), via, str(out)], tmp / f"{via}.log", tmp)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"ranks": ranks, "weights": load_file(out / "weights.safetensors")}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_siblings_is_bit_identical_and_leaner(stage: int, tmp_path: Path) -> None:
    spec = {"stage": stage, "dims": [8192, 768, 1024], "steps_before": 2, "steps_after": 3}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    ckpt = tmp_path / "ckpt"
    _torchrun(["save", str(spec_file), str(ckpt)], tmp_path / "save.log", tmp_path)
    tag_dir = ckpt / (ckpt / "latest").read_text().strip()
    optim = sorted(tag_dir.glob("*_optim_states.pt"))
    assert len(optim) == 2 and all(p.stat().st_size > 2 * 40 * MiB for p in optim)

    assert main(["lazify", str(ckpt), "--memory", BUDGET]) == 0
    pt_files = sorted(tag_dir.glob("*.pt"))
    assert sorted(tag_dir.glob("*.pt.safetensors")) == [
        p.with_name(p.name + ".safetensors") for p in pt_files
    ]

    plain = _resume(spec_file, ckpt, "pt", tmp_path)
    lazy = _resume(spec_file, ckpt, "lazy", tmp_path)

    for p_rank, l_rank in zip(plain["ranks"], lazy["ranks"], strict=True):
        assert l_rank["losses"] == p_rank["losses"], (stage, p_rank["rank"])
        # each rank read its own optimizer file, and no other rank's, from its sibling
        own = f"zero_pp_rank_{l_rank['rank']}_mp_rank_00_optim_states.pt"
        assert own in l_rank["loaded"] and l_rank["fell_back"] == []
        assert not [n for n in l_rank["loaded"] if "optim_states" in n and n != own]
    assert plain["weights"].keys() == lazy["weights"].keys()
    for name, want in plain["weights"].items():
        assert torch.equal(lazy["weights"][name].view(torch.uint8), want.view(torch.uint8)), name

    optim_bytes = optim[0].stat().st_size
    lines = [f"ZeRO-{stage}, 2 ranks, optimizer file {optim_bytes / MiB:.1f} MiB per rank:"]
    for p_rank, l_rank in zip(plain["ranks"], lazy["ranks"], strict=True):
        lines.append(
            f"  rank {p_rank['rank']}: load_checkpoint peak RSS +{p_rank['load_peak_rss_bytes'] / MiB:.1f} MiB"
            f" (anonymous +{p_rank['load_peak_anon_bytes'] / MiB:.1f}) in {p_rank['load_seconds']:.2f} s from .pt;"
            f" +{l_rank['load_peak_rss_bytes'] / MiB:.1f} MiB (anonymous +{l_rank['load_peak_anon_bytes'] / MiB:.1f})"
            f" in {l_rank['load_seconds']:.2f} s from siblings"
        )
    print("\n" + "\n".join(lines))
    for p_rank, l_rank in zip(plain["ranks"], lazy["ranks"], strict=True):
        # loading the .pt puts the whole optimizer file in anonymous memory (the measured rise
        # is smaller where malloc reuses pages freed before the load); the sibling puts a tiny
        # fraction of it there
        assert l_rank["load_peak_anon_bytes"] < 0.1 * optim_bytes
        assert p_rank["load_peak_anon_bytes"] - l_rank["load_peak_anon_bytes"] > optim_bytes / 2
        assert l_rank["load_peak_rss_bytes"] < p_rank["load_peak_rss_bytes"]
