"""`zerosafe pt2st`: convert and verify, inspect, list globals, refusals as one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.pt2st.helpers import assert_same
from zerosafe.pt2st import load_pt_like
from zerosafe_app.cli import main


class Opaque:
    pass


def test_convert_verify_and_rerun(tmp_path: Path, capsys) -> None:
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.randn(3, 4), "state": {0: {"step": torch.tensor(1.0)}}}, pt)
    assert main(["pt2st", str(pt), "--json", "--memory", "64MiB"]) == 0
    summary = json.loads(capsys.readouterr().out)
    out = tmp_path / "model.safetensors"  # the default output name
    assert summary["status"] == "converted" and summary["destination"] == str(out)
    assert summary["verify"]["ok"] and summary["verify"]["checksums_compared"] == 2
    assert_same(load_pt_like(str(out)), torch.load(pt))
    assert main(["pt2st", str(pt), str(out)]) == 0
    assert "already a conversion" in capsys.readouterr().out


def test_inspect_writes_nothing(tmp_path: Path, capsys) -> None:
    pt = tmp_path / "x.pt"
    base = torch.randn(10)
    torch.save({"a": base, "b": base[2:5]}, pt)
    assert main(["pt2st", "--inspect", "--json", str(pt)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["num_tensors"], report["num_entries"], report["num_views"]) == (2, 1, 1)
    assert "torch._utils._rebuild_tensor_v2" in report["globals"]
    assert not (tmp_path / "x.safetensors").exists()


def test_refused_global_is_one_line_and_listed(tmp_path: Path, capsys) -> None:
    pt = tmp_path / "x.pt"
    torch.save({"w": torch.ones(1), "cfg": Opaque()}, pt)
    assert main(["pt2st", str(pt)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{__name__}.Opaque'" in err
    assert main(["pt2st", "--list-globals", str(pt)]) == 0
    out = capsys.readouterr().out
    assert f"REFUSED  {__name__}.Opaque" in out
    assert "allowed  torch._utils._rebuild_tensor_v2" in out
    assert not (tmp_path / "x.safetensors").exists()
