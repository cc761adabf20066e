"""Hugging Face safetensors folders as input (issue 39): `save_pretrained`'s sharded and
single-file folders, and zerosafe's own output converted again, through the `zerosafe`
command; every tensor bit-equal to the live weights, and refusals of a folder whose index and
files disagree."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import SAMPLE_CKPT
from tests.formats.dcp.helpers import same_bits
from tests.formats.dcp.test_convert import convert, load_output, run
from tests.formats.safetensors_in.conftest import copy_folder, input_ids
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.registry import detect_format
from zerosafe.io.storage import Storage
from zerosafe.stages import output as stages_output

Folder = Callable[[str], Path]
Live = Callable[[str], dict[str, torch.Tensor]]


def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids()).logits


@pytest.mark.parametrize("name", ["sharded", "tied"])
def test_fp32_bit_equal_verify_and_from_pretrained(
    name: str, hf_folder: Folder, hf_live: Live, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = hf_folder(name), tmp_path / "out"
    result = convert(capsys, src, out, "--dtype", "fp32")
    assert not result.get("warnings"), result.get("warnings")  # the tied config agrees
    got, live = load_output(out), hf_live(name)
    stored = {k for f in src.glob("*.safetensors") for k in load_file(f)}
    assert set(got) == stored  # the tied head stays out, as save_pretrained left it
    for key in stored:
        assert same_bits(got[key], live[key]), key
    assert (out / "config.json").exists()
    code, _, err = run(capsys, "verify", str(out), "--against", str(src))
    assert code == 0, err
    assert torch.equal(_logits(out), _logits(src))


def test_bf16_keep_fp32_and_shard_size(
    hf_folder: Folder, hf_live: Live, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    convert(
        capsys, hf_folder("sharded"), out,
        "--dtype", "bf16", "--max-shard-size", "4KB", "--keep-fp32", "norm",
    )  # fmt: skip
    assert len(list(out.glob("model-*.safetensors"))) > 2
    got = load_output(out)
    for key, ref in hf_live("sharded").items():
        want = ref if "norm" in key else ref.to(torch.bfloat16)
        assert same_bits(got[key], want), key
    code, _, err = run(capsys, "verify", str(out), "--against", str(hf_folder("sharded")))
    assert code == 0, err


def _metadata(path: Path) -> dict[str, str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return dict(json.loads(f.read(n)).get("__metadata__", {}))


def test_zerosafe_output_converted_again_keeps_its_aliases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    convert(capsys, SAMPLE_CKPT, first)
    tied = json.loads(_metadata(first / "model.safetensors")["aliases"])
    assert tied  # the sample ties lm_head.weight to embed.weight
    convert(capsys, first, second, "--max-shard-size", "4KB")  # one file -> shards + index
    index = json.loads((second / "model.safetensors.index.json").read_text())
    assert index["metadata"]["aliases"] == tied
    assert not set(tied) & set(index["weight_map"])
    convert(capsys, second, third)  # shards + index -> one file
    assert json.loads(_metadata(third / "model.safetensors")["aliases"]) == tied
    want = load_output(first)
    got = load_output(third)
    assert set(got) == set(want)
    assert all(same_bits(got[k], v) for k, v in want.items())
    code, _, err = run(capsys, "verify", str(third), "--against", str(second))
    assert code == 0, err


def _refused(capsys: pytest.CaptureFixture[str], src: Path, out: Path, *match: str) -> str:
    code, _, err = run(capsys, "convert", str(src), str(out), "--via", "local")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    for m in match:
        assert m in err, err
    return err


def test_index_and_files_disagree_refused(
    hf_folder: Folder, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = copy_folder(hf_folder("sharded"), tmp_path / "src")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    files = list(weight_map.values())
    name, file = next((k, v) for k, v in weight_map.items() if files.count(v) > 1)
    # a tensor in a header but not in the map (its file holds others), or a whole file
    index["weight_map"] = {k: v for k, v in weight_map.items() if k != name}
    index_path.write_text(json.dumps(index))
    assert file in index["weight_map"].values()
    _refused(capsys, src, tmp_path / "a", file, f"'{name}'", "does not list it")
    index["weight_map"] = {k: v for k, v in weight_map.items() if v != file}
    index_path.write_text(json.dumps(index))
    _refused(capsys, src, tmp_path / "a", file, "lists no tensor of")
    # the map names a tensor the file does not hold
    index["weight_map"] = {**weight_map, "extra.weight": file}
    index_path.write_text(json.dumps(index))
    _refused(capsys, src, tmp_path / "b", "'extra.weight'", "whose header has no such tensor")
    # a file the map names is missing
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index))
    (src / file).unlink()
    _refused(capsys, src, tmp_path / "c", file, "not in the folder")


def test_truncated_file_and_same_folder_refused(
    hf_folder: Folder, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = copy_folder(hf_folder("tied"), tmp_path / "src")
    _refused(capsys, src, src, "found the checkpoint folder itself")
    path = src / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4])
    _refused(capsys, src, tmp_path / "out", "model.safetensors", "truncated")


def test_detection(hf_folder: Folder, tmp_path: Path) -> None:
    from zerosafe.formats import nested

    storage = Storage()
    assert detect_format(storage, str(hf_folder("sharded"))).name == "safetensors"
    assert detect_format(storage, str(hf_folder("tied"))).name == "safetensors"
    # a zerosafe output being written (work folder, no completion marker) is not a source
    assert nested.OUTPUT_WORK_DIR == stages_output.WORK_DIR_NAME
    assert nested.OUTPUT_MARKER == stages_output.MARKER_NAME
    half = copy_folder(hf_folder("tied"), tmp_path / "half")
    (half / stages_output.WORK_DIR_NAME).mkdir()
    with pytest.raises(CheckpointFormatError, match="a zerosafe output still being written"):
        detect_format(storage, str(half))
    (half / stages_output.MARKER_NAME).write_text("{}")
    assert detect_format(storage, str(half)).name == "safetensors"
    # two safetensors files and no index: which is the model is not known
    two = copy_folder(hf_folder("tied"), tmp_path / "two")
    (two / "model.safetensors").rename(two / "a.safetensors")
    (two / "b.safetensors").write_bytes((two / "a.safetensors").read_bytes())
    with pytest.raises(CheckpointFormatError, match="without a `model.safetensors.index.json`"):
        detect_format(storage, str(two))
