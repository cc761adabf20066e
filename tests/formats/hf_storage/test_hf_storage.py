"""Saves of torch's `HuggingFaceStorageWriter(save_distributed=True)` (issue 39): every
rank's chunks reassembled into the global tensors, bit-equal to the FSDP2 model's live
weights; the consolidated folder beside `sharded/`; lost or inconsistent rank files refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.formats.dcp.helpers import same_bits
from tests.formats.dcp.test_convert import convert, load_output, run


def _assert_live(out: Path, live: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    got = load_output(out)
    assert set(got) == set(live)
    for key, ref in live.items():
        assert same_bits(got[key], ref.to(dtype)), key


@pytest.mark.parametrize(("name", "dtype"), [("plain", "fp32"), ("consolidated/sharded", "bf16")])
def test_rank_files_reassembled(
    name: str,
    dtype: str,
    hf_storage_root: Path,
    hf_storage_live: dict[str, torch.Tensor],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, out = hf_storage_root / name, tmp_path / "out"
    result = convert(capsys, src, out, "--dtype", dtype, "--max-shard-size", "1KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert any("reassembled from chunks of 2 rank(s)" in n for n in result["notes"])
    _assert_live(out, hf_storage_live, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    code, _, err = run(capsys, "verify", str(out), "--against", str(src))
    assert code == 0, err


def test_parent_of_sharded_converts_the_consolidated_files(
    hf_storage_root: Path,
    hf_storage_live: dict[str, torch.Tensor],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, out = hf_storage_root / "consolidated", tmp_path / "out"
    result = convert(capsys, src, out)
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert manifest["source"]["format"] == "safetensors"
    assert any(f"{src}/sharded holds the same save" in n for n in result["notes"])
    _assert_live(out, hf_storage_live, torch.float32)


def test_output_inside_the_folder_given_is_no_second_save(
    hf_storage_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`convert parent parent/hf` is refused (an output inside its source); a zerosafe output
    moved inside the folder later (or left there by an older version), which a reader claims,
    is no second save: `parent` still finds the save one level down."""
    parent = tmp_path / "parent"
    shutil.copytree(hf_storage_root / "plain", parent / "step4")
    code, _, err = run(capsys, "convert", str(parent), str(parent / "hf"), "--via", "local")
    assert code == 2 and "found a folder inside the checkpoint folder" in err, err
    first = convert(capsys, parent, tmp_path / "hf")
    assert any(f"converting {parent}/step4" in n for n in first["notes"])
    shutil.move(tmp_path / "hf", parent / "hf")
    again = convert(capsys, parent, tmp_path / "hf2")
    assert any(f"converting {parent}/step4" in n for n in again["notes"]), again
    (parent / "hf" / "zerosafe-complete.json").unlink()  # as if being written again
    (parent / "hf" / ".zerosafe-work").mkdir()
    code, _, err = run(capsys, "inspect", str(parent))
    assert code == 0, err


def _refused(capsys: pytest.CaptureFixture[str], src: Path, out: Path, *match: str) -> None:
    code, _, err = run(capsys, "convert", str(src), str(out), "--via", "local")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    for m in match:
        assert m in err, err


def test_lost_or_inconsistent_rank_files_refused(
    hf_storage_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    shutil.copytree(hf_storage_root / "plain", src)
    first = src / "shard-00001-model-00001-of-00001.safetensors"
    second = src / "shard-00002-model-00001-of-00001.safetensors"
    kept = first.read_bytes()
    first.unlink()  # rank 0's file lost
    _refused(capsys, src, tmp_path / "a", "shard-00001-model-*.safetensors", "missing")
    first.write_bytes(kept)
    # rank 1's embedding chunk placed one row too early: it overlaps rank 0's
    tensors = load_file(second)
    with open(second, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    metadata = header["__metadata__"]
    info = json.loads(metadata["DCP_SHARDING_INFO"])
    info["embed.weight"]["saved_offsets"][0] -= 1
    save_file(tensors, second, metadata={**metadata, "DCP_SHARDING_INFO": json.dumps(info)})
    _refused(capsys, src, tmp_path / "b", "'embed.weight'", "chunks overlap")
    # ... or one row too late: a row of the tensor is in no chunk
    info["embed.weight"]["saved_offsets"][0] += 2
    save_file(tensors, second, metadata={**metadata, "DCP_SHARDING_INFO": json.dumps(info)})
    _refused(capsys, src, tmp_path / "c", "'embed.weight'", "is in no chunk")
    # a chunk of another dtype
    info["embed.weight"]["saved_offsets"][0] -= 1
    tensors["embed.weight"] = tensors["embed.weight"].to(torch.bfloat16)
    save_file(tensors, second, metadata={**metadata, "DCP_SHARDING_INFO": json.dumps(info)})
    _refused(capsys, src, tmp_path / "d", "'embed.weight'", "different saves")
