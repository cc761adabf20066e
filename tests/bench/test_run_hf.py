"""bench/run_hf.py: zerosafe's first command against the frameworks' own consolidation tools
on saves they write (issue 39). The output comparison is exact; no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.run_hf import same_tensors  # noqa: E402


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 3, generator=g),
        "b.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "c.scale": torch.tensor(0.0),
    }


def _folder(path: Path, tensors: dict[str, torch.Tensor], split: bool) -> str:
    path.mkdir()
    if split:  # the same tensors cut into two files, as torch's consolidation may write them
        names = sorted(tensors)
        save_file(
            {k: tensors[k] for k in names[:1]}, str(path / "model-00001-of-00002.safetensors")
        )
        save_file(
            {k: tensors[k] for k in names[1:]}, str(path / "model-00002-of-00002.safetensors")
        )
    else:
        save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def test_same_tensors_compares_bytes_across_file_splits(tmp_path: Path) -> None:
    base = _tensors()
    one = _folder(tmp_path / "one", base, split=False)
    assert same_tensors(one, _folder(tmp_path / "two", base, split=True)) == (
        True, "3 tensors bit-exact"
    )  # fmt: skip
    flipped = dict(base, **{"a.weight": base["a.weight"].clone()})
    flipped["a.weight"].view(-1).view(torch.int32)[7] ^= 1  # one bit of one element
    assert same_tensors(one, _folder(tmp_path / "bit", flipped, split=True))[1].startswith(
        "a.weight"
    )
    negzero = dict(base, **{"c.scale": torch.tensor(-0.0)})  # equal as numbers, not as bytes
    assert not same_tensors(one, _folder(tmp_path / "zero", negzero, split=False))[0]
    cast = dict(base, **{"b.weight": base["b.weight"].float()})
    assert "float32" in same_tensors(one, _folder(tmp_path / "dtype", cast, split=False))[1]
    fewer = {k: v for k, v in base.items() if k != "c.scale"}
    assert "c.scale" in same_tensors(one, _folder(tmp_path / "fewer", fewer, split=False))[1]


@pytest.mark.slow
def test_run_hf_sharded_tiny_end_to_end(tmp_path: Path) -> None:
    """`bench/run.py --format hf-sharded`: torch writes the save on 2 gloo ranks, zerosafe and
    torch's consolidation both convert it, their outputs are equal, the save is removed."""
    before = set(Path("/tmp").glob("zerosafe-bench-hf-*"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--format", "hf-sharded", "--size",
         "tiny", "--params", "2M", "--cache", "cold", "--settle", "0",
         "--results", str(tmp_path), "--name", "r"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["same_output"] is True
    kinds = {(r["layout"], r["kind"]): r for r in result["summary"]}
    assert set(kinds) == {("hf-sharded", k) for k in ("io-limit", "zerosafe", "torch")}
    assert all(r["ok"] for r in kinds.values())
    assert kinds[("hf-sharded", "zerosafe")]["within_memory"] is True
    assert kinds[("hf-sharded", "torch")]["wall_over_zerosafe"] > 0
    save = result["saves"]["hf-sharded"]
    assert save["num_params"] > 10**6 and save["read_bytes"] == save["out_bytes"]
    assert set(Path("/tmp").glob("zerosafe-bench-hf-*")) == before  # the temporary save went
