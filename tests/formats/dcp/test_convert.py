"""DCP checkpoints through the format-agnostic stages (merge, verify, publish) and compared with
torch's `dcp_to_torch_save`, bit-exact after the dtype policy (an exact cast from the saved
dtype). TODO(format-reader interface): run this through `convert_checkpoint` and the CLI once
the planner takes any format's layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.formats.dcp.helpers import same_bits
from zerosafe.config import ConvertOptions
from zerosafe.formats.dcp.plan import build_dcp_plan
from zerosafe.formats.dcp.reader import read_dcp_layout
from zerosafe.io.storage import Storage
from zerosafe.pipeline import WorkLayout, _run_stages
from zerosafe.plan.model import save_plan
from zerosafe.stages.output import default_work_url, finish_work, prepare_output, publish
from zerosafe.stages.progress import NullProgress
from zerosafe.stages.shards import check_integrity


def _convert(src: Path, out: Path, options: ConvertOptions) -> dict[str, Any]:
    storage = Storage()
    plan = build_dcp_plan(read_dcp_layout(str(src), storage), options)
    prepare_output(storage, str(out), plan.plan_id, overwrite=False)
    work = WorkLayout(default_work_url(str(out), plan.plan_id))
    save_plan(plan, storage, work.plan)
    extracts, merges, verifies = _run_stages(plan, storage, str(out), work, options, NullProgress())
    integrity = check_integrity(
        plan, storage, [e["ledger"] for e in extracts] + [m["ledger"] for m in merges],
        intermediate_url=None if options.direct else work.intermediate,
    ).as_dict()  # fmt: skip
    manifest = publish(
        plan, storage, str(out), options=options, merges=merges, verifies=verifies,
        integrity=integrity, stats={},
    )  # fmt: skip
    finish_work(storage, str(out), plan.plan_id, work.root, keep=False)
    return {"integrity": integrity, "manifest": manifest}


def _load_output(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.parametrize(
    ("name", "dtype", "direct"),
    [("dtensor", "float32", True), ("dtensor", "bfloat16", False), ("fsdp2", "float32", False)],
)
def test_convert_matches_oracle(
    name: str,
    dtype: str,
    direct: bool,
    dcp_checkpoint: Callable[[str], Path],
    dcp_oracle: Callable[[str], dict[str, object]],
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    options = ConvertOptions(dtype=dtype, direct=direct, max_shard_bytes=3000)
    result = _convert(dcp_checkpoint(name), out, options)
    assert (out / "zerosafe-complete.json").exists()
    integrity = result["integrity"]
    assert integrity["records_failed"] == [] and integrity["records_skipped"] == []
    got = _load_output(out)
    oracle = {
        k.removeprefix("model."): v
        for k, v in dcp_oracle(name).items()
        if k.startswith("model.") and isinstance(v, torch.Tensor)
    }
    assert set(got) == set(oracle)
    for key, ref in oracle.items():
        want = ref.to(getattr(torch, dtype)) if ref.is_floating_point() else ref
        assert same_bits(got[key], want), key
    manifest = result["manifest"]
    assert manifest["source"]["format"] == "dcp"
    assert "step" in manifest["source"]["non_tensor_entries"] or name == "fsdp2"
