"""ByteCheckpoint checkpoints (issue 39): `global_step_N/` as ByteCheckpoint's own
`bytecheckpoint.save` writes it (FSDP2, 2 gloo ranks), its `.metadata` read as data, its raw
chunk bytes placed by the tensor pickles in `all_tensor_metadata`, `model/` converted bit-exact
against the live weights, `optimizer/` never converted as weights, `extra_state/` listed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.formats.dcp.helpers import same_bits
from zerosafe.errors import CheckpointFormatError
from zerosafe.formats.dcp.metadata import parse_metadata
from zerosafe_app.cli import main

pytestmark = pytest.mark.slow

BYTECHECKPOINT = "bytecheckpoint.checkpointer.meta_type"


def _step(root: Path) -> Path:
    return root / "ckpt" / "global_step_3"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _convert(capsys: pytest.CaptureFixture[str], src: Path, out: Path) -> dict[str, Any]:
    code, stdout, err = _run(capsys, "convert", str(src), str(out), "--via", "local", "--json")
    assert code == 0, err
    return dict(json.loads(stdout))


def test_metadata_reads_bytecheckpoint_classes(bytecheckpoint_root: Path) -> None:
    """Before issue 39 the file was refused: ByteCheckpoint's `Metadata` was no allowed
    global."""
    path = _step(bytecheckpoint_root) / "model" / ".metadata"
    meta = parse_metadata(path.read_bytes(), str(path))
    assert {f"{BYTECHECKPOINT}.Metadata", f"{BYTECHECKPOINT}._StorageInfo"} <= meta.globals_found
    assert meta.writers == ("ByteCheckpoint",) and meta.version is None
    assert "embed.weight" in meta.tensors and not meta.byte_entries
    sizes = {p.name: p.stat().st_size for p in path.parent.glob("*.distcp")}
    for (fqn, offsets), info in meta.storage.items():
        raw = info.raw_tensor  # every chunk's bytes are described by its tensor pickle
        assert raw is not None and offsets is not None
        assert (offsets, raw.shape) in meta.tensors[fqn].chunks
        assert info.length == raw.storage.numel * raw.itemsize
        assert info.offset + info.length <= sizes[info.relative_path]
    rows = sorted(s[0] for _, s in meta.tensors["embed.weight"].chunks)
    assert rows == [18, 19]  # 37 rows over 2 ranks: uneven chunks


def test_global_step_folder_converts_bit_exact_and_verifies(
    bytecheckpoint_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step, out = _step(bytecheckpoint_root), tmp_path / "out"
    summary = _convert(capsys, step, out)
    assert summary["status"] == "converted"
    notes = " | ".join(summary["notes"])
    assert f"converting {step}/model (the only save in {step}" in notes
    assert f"not read, beside it in {step}: extra_state/, optimizer/" in notes
    got = load_file(out / "model.safetensors")
    live = load_file(bytecheckpoint_root / "live.safetensors")
    assert sorted(got) == sorted([*live, "head.weight"])  # the tied head, as the state dict has it
    for name, ref in live.items():
        assert same_bits(got[name], ref), name
    assert same_bits(got["head.weight"], live["embed.weight"])
    code, stdout, _ = _run(capsys, "verify", str(out), "--against", str(step), "--json")
    report = json.loads(stdout)
    assert code == 0, report["failures"]
    assert report["against"]["source_identity"] == "same contents"
    code, stdout, _ = _run(capsys, "inspect", str(step))
    assert code == 0 and "extra_state/" in stdout and "ByteCheckpoint" in stdout


def test_optimizer_folder_is_never_converted_as_weights(
    bytecheckpoint_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _step(bytecheckpoint_root) / "optimizer"
    code, _, err = _run(capsys, "convert", str(src), str(tmp_path / "out"), "--via", "local")
    assert code == 2 and "holds optimizer state only" in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_truncated_chunk_file_is_refused(
    bytecheckpoint_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = shutil.copytree(_step(bytecheckpoint_root) / "model", tmp_path / "model")
    distcp = model / "__1_0.distcp"
    distcp.write_bytes(distcp.read_bytes()[:-8])
    code, _, err = _run(capsys, "convert", str(model), str(tmp_path / "out"), "--via", "local")
    assert code == 2 and "__1_0.distcp" in err and "truncated" in err
    assert len(err.strip().splitlines()) == 1


def test_chunk_without_its_tensor_pickle_is_refused(bytecheckpoint_root: Path) -> None:
    """A raw chunk whose tensor pickle is missing cannot be placed: refused, not guessed."""
    import pickle

    import bytecheckpoint  # noqa: F401  (its classes, to rewrite its own metadata)

    path = _step(bytecheckpoint_root) / "model" / ".metadata"
    meta = pickle.loads(path.read_bytes())  # the test's own file, written by ByteCheckpoint
    key = next(k for k in meta.all_tensor_metadata if k.fqn == "layers.0.weight")
    del meta.all_tensor_metadata[key]
    with pytest.raises(CheckpointFormatError, match="'layers.0.weight' has a chunk at offsets"):
        parse_metadata(pickle.dumps(meta), str(path))


def test_layout_reads_raw_chunks_in_place(bytecheckpoint_root: Path) -> None:
    from tests.formats.dcp.helpers import assemble
    from zerosafe.formats.dcp.reader import read_dcp_layout
    from zerosafe.formats.registry import find_save
    from zerosafe.io.storage import Storage

    # the folder given to bytecheckpoint.save: its latest_checkpointed_iteration.txt names step 3
    found = find_save(Storage(), str(bytecheckpoint_root / "ckpt"))
    assert found.url == str(_step(bytecheckpoint_root) / "model")
    layout = read_dcp_layout(found.url, Storage())
    live = load_file(bytecheckpoint_root / "live.safetensors")
    assert {s.kind for s in layout.slots} == {"chunk"} and len(layout.slots) > len(live)
    for name, ref in live.items():
        assert torch.equal(assemble(layout, layout.tensors[name]), ref), name


def test_chunk_length_disagreeing_with_its_tensor_is_refused(
    bytecheckpoint_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pickle

    import bytecheckpoint  # noqa: F401  (its classes, to rewrite its own metadata)

    model = shutil.copytree(_step(bytecheckpoint_root) / "model", tmp_path / "model")
    meta = pickle.loads((model / ".metadata").read_bytes())
    key = next(k for k in meta.storage_data if k.fqn == "norm.weight")
    meta.storage_data[key].length -= 4  # one float32 short of its storage
    (model / ".metadata").write_bytes(pickle.dumps(meta))
    code, _, err = _run(capsys, "convert", str(model), str(tmp_path / "out"), "--via", "local")
    assert code == 2 and "'norm.weight'" in err and "disagrees with the metadata" in err
