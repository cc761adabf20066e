"""torch_checkpointing saves (written by the library's own `CheckpointManager`, see conftest.py)
through the `zerosafe` command: bit-exact against the live weights, and one-line refusals of
what is not read. Issue 39: both layouts were refused with DeepSpeed's "no 'latest' file"."""

from __future__ import annotations

import itertools
import json
import math
import pickle
import pickletools
import shutil
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError, ConfigError, UnsafePickleError
from zerosafe.formats.registry import detect_format, quick_identities, read_source
from zerosafe.formats.torch_checkpointing.metadata import Placement, ShardedTensor, parse_metadata
from zerosafe.formats.torch_checkpointing.safetensors_layout import local_box
from zerosafe.formats.torch_pickle import ALLOWED_GLOBALS
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import Storage
from zerosafe_app.cli import main

Save = Callable[[str], Path]
slow = pytest.mark.slow  # the session's save trains FSDP2 on 2 spawned ranks


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def convert(
    capsys: pytest.CaptureFixture[str], src: Path, out: Path, *extra: str
) -> dict[str, Any]:
    code, stdout, err = run(
        capsys, "convert", str(src), str(out), "--via", "local", "--json", *extra
    )
    assert code == 0, err
    return dict(json.loads(stdout))


def refused(capsys: pytest.CaptureFixture[str], src: Path, out: Path) -> str:
    code, _, err = run(capsys, "convert", str(src), str(out), "--via", "local")
    assert code == 2, err
    line = err.strip()
    assert "\n" not in line and line.startswith("zerosafe: error: "), err
    assert not out.exists() or not any(out.iterdir())  # nothing written
    return line


@slow
def test_the_save_folder_and_its_parent_are_detected(tc_save: Save) -> None:
    storage = Storage()
    step = tc_save("pt")
    assert detect_format(storage, str(step)).name == "torch_checkpointing"
    assert detect_format(storage, str(step.parent)).name == "torch_checkpointing"  # one down


@slow
def test_the_model_item_converts_bit_exact_and_the_optimizer_is_never_read(
    tc_save: Save, tc_root: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    step, out = tc_save("pt"), tmp_path / "out"
    summary = convert(capsys, step, out)
    assert summary["status"] == "converted" and not summary["warnings"]
    got = load_file(out / "model.safetensors")
    live = load_file(tc_root / "live.safetensors")
    assert set(got) == set(live)
    for name, tensor in got.items():
        assert tensor.dtype == live[name].dtype == torch.float32, name
        assert torch.equal(tensor, live[name]), name
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    read = [Path(f["url"]).name for f in manifest["source"]["files"]]
    assert read == ["model_0.pt", "model_1.pt"]
    assert manifest["source"]["other_items"] == ["optim", "step"]


@slow
def test_bf16_is_torchs_cast_of_the_live_weights(
    tc_save: Save, tc_root: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    convert(capsys, tc_save("pt"), out, "--dtype", "bf16")
    got = load_file(out / "model.safetensors")
    live = load_file(tc_root / "live.safetensors")
    assert set(got) == set(live)
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, live[name].to(torch.bfloat16)), name


@slow
def test_verify_against_the_save(
    tc_save: Save, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    step, out = tc_save("pt"), tmp_path / "out"
    convert(capsys, step, out)
    code, stdout, err = run(capsys, "verify", str(out), "--against", str(step))
    assert code == 0, stdout + err
    assert "source same contents" in stdout


@slow
def test_rank_files_are_read_as_records_through_the_allowlist(tc_save: Save) -> None:
    archive = TorchZipFile(Storage().open_source(str(tc_save("pt") / "model_1.pt")))
    archive.load()
    archive.source.close()
    assert archive.globals_found <= set(ALLOWED_GLOBALS)
    assert "torch.distributed.tensor.DTensor" in archive.globals_found


@slow
def test_inspect_lists_the_other_items_and_the_job_identity(
    tc_save: Save, capsys: pytest.CaptureFixture[str]
) -> None:
    step = tc_save("pt")
    code, stdout, err = run(capsys, "inspect", str(step))
    assert code == 0, err
    assert "(torch_checkpointing, world size 2)" in stdout
    assert "other items (never read): optim (2 file(s)), step (2 file(s))" in stdout
    assert "Shard(0) x 10, plain x 1 (2 split unevenly over the ranks)" in stdout
    storage, options = Storage(), ConvertOptions()
    layout = read_source(storage, str(step), tag=None, options=options)
    assert quick_identities(storage, str(step), None) == (layout.tag, layout.identities)
    assert layout.tag == "step_1"
    with pytest.raises(ConfigError, match="one save"):
        read_source(storage, str(step), tag="step_9", options=options)


@slow
def test_a_missing_model_rank_file_is_refused_naming_it(
    tc_save: Save, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    step = tmp_path / "step_1"
    shutil.copytree(tc_save("pt"), step)
    (step / "model_1.pt").unlink()
    line = refused(capsys, step, tmp_path / "out")
    assert "model_1.pt is missing" in line and "model_R.pt for R = 0..1" in line
    for other in step.glob("[os]*_1.pt"):  # no other item names rank 1: the mesh does
        other.unlink()
    line = refused(capsys, step, tmp_path / "out")
    assert "sharded over 2 ranks" in line and "model_1.pt missing" in line


@slow
def test_the_safetensors_layout_converts_bit_exact_placed_by_its_metadata(
    tc_save: Save, tc_root: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`model_R.safetensors` hold local shards under their full names; metadata.pkl places
    them (it was refused before: issue 39)."""
    step, out = tc_save("st"), tmp_path / "out"
    assert detect_format(Storage(), str(step)).name == "torch_checkpointing"
    summary = convert(capsys, step, out)
    assert summary["status"] == "converted" and not summary["warnings"]
    got = load_file(out / "model.safetensors")
    live = load_file(tc_root / "live.safetensors")
    assert set(got) == set(live)
    for name, tensor in got.items():
        assert tensor.dtype == live[name].dtype == torch.float32, name
        assert torch.equal(tensor, live[name]), name
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    read = [Path(f["url"]).name for f in manifest["source"]["files"]]
    assert read == ["model_0.safetensors", "model_1.safetensors"]
    assert manifest["source"]["other_items"] == ["optim", "step"]
    code, stdout, err = run(capsys, "verify", str(out), "--against", str(step))
    assert code == 0, stdout + err
    assert "source same contents" in stdout


@slow
def test_the_safetensors_layout_in_bf16_is_torchs_cast(
    tc_save: Save, tc_root: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    convert(capsys, tc_save("st"), out, "--dtype", "bf16")
    got = load_file(out / "model.safetensors")
    live = load_file(tc_root / "live.safetensors")
    assert set(got) == set(live)
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, live[name].to(torch.bfloat16)), name


@slow
def test_inspect_shows_the_safetensors_layout(
    tc_save: Save, capsys: pytest.CaptureFixture[str]
) -> None:
    step = tc_save("st")
    code, stdout, err = run(capsys, "inspect", str(step))
    assert code == 0, err
    assert "(torch_checkpointing, world size 2)" in stdout
    assert "safetensors layout, placed by metadata.pkl" in stdout
    assert "Replicate() x 1, Shard(0) x 10 (2 split unevenly over the ranks)" in stdout
    storage = Storage()
    layout = read_source(storage, str(step), tag=None, options=ConvertOptions())
    assert quick_identities(storage, str(step), None) == (layout.tag, layout.identities)
    pt = read_source(storage, str(tc_save("pt")), tag=None, options=ConvertOptions())
    assert layout.source.content_sha256 != pt.source.content_sha256


@slow
def test_metadata_pkl_is_read_as_builtins_only(tc_save: Save, tmp_path: Path) -> None:
    """The library pickles `DistributedMetadata.to_dict()`: no global is allowed, and a field
    zerosafe does not know is refused rather than ignored."""
    step = tmp_path / "step_1"
    shutil.copytree(tc_save("st"), step)
    real = (step / "metadata.pkl").read_bytes()
    assert not [op for op, _, _ in pickletools.genops(real) if "GLOBAL" in op.name]
    meta = parse_metadata(real, "metadata.pkl", item="model")
    assert meta.rank_files == {0: "model_0.safetensors", 1: "model_1.safetensors"}
    embed = meta.tensors["embed.weight"][0]
    assert (embed.global_shape, embed.dtype, embed.ranks) == ((67, 24), "float32", (0, 1))
    raw = pickle.loads(real)  # our own save
    group = raw["metadata"]["model"]["nested_path_to_metadata"]['["embed.weight"]'][0]
    group["sharding_metadata"]["data"]["local_offsets"] = [0, 0]
    with pytest.raises(CheckpointFormatError, match=r"unknown: \['local_offsets'\]"):
        parse_metadata(pickle.dumps(raw), "metadata.pkl", item="model")
    del group["sharding_metadata"]["data"]["local_offsets"]
    group["sharding_metadata"]["data"]["stride"] = PurePosixPath("x")
    with pytest.raises(UnsafePickleError, match="names the global 'pathlib"):
        parse_metadata(pickle.dumps(raw), "metadata.pkl", item="model")


@slow
def test_a_missing_safetensors_rank_file_is_refused_naming_it(
    tc_save: Save, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    step = tmp_path / "step_1"
    shutil.copytree(tc_save("st"), step)
    (step / "model_1.safetensors").unlink()
    line = refused(capsys, step, tmp_path / "out")
    assert "model_1.safetensors is missing" in line and "model_R.safetensors for R = 0..1" in line
    for other in step.glob("[os]*_1.pt"):  # no other item names rank 1: metadata.pkl does
        other.unlink()
    line = refused(capsys, step, tmp_path / "out")
    assert "metadata.pkl places the model shards of 2 ranks" in line
    assert "model_1.safetensors (rank 1) is missing" in line
    (step / "metadata.pkl").unlink()
    line = refused(capsys, step, tmp_path / "out")
    assert "without metadata.pkl" in line and "resharder" in line


def _tamper_header(path: Path, old: bytes, new: bytes) -> None:
    """Rewrite part of a safetensors header in place, keeping its length (a valid file)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + size]
    assert len(old) == len(new) and header.count(old) == 1, header
    path.write_bytes(data[:8] + header.replace(old, new) + data[8 + size :])


@slow
def test_a_header_that_disagrees_with_metadata_pkl_is_refused(
    tc_save: Save, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    step = tmp_path / "step_1"
    shutil.copytree(tc_save("st"), step)
    rank1 = step / "model_1.safetensors"
    real = rank1.read_bytes()
    _tamper_header(rank1, b'"shape":[33,24]', b'"shape":[24,33]')  # embed.weight's rows
    line = refused(capsys, step, tmp_path / "out")
    assert "model_1.safetensors: 'embed.weight' is float32 [24, 33] in the header" in line
    assert "metadata.pkl records a float32 shard of [33, 24]" in line
    rank1.write_bytes(real)
    _tamper_header(rank1, b'"head.weight"', b'"head.wEight"')
    line = refused(capsys, step, tmp_path / "out")
    assert "the header lacks ['head.weight'], which metadata.pkl places on rank 1" in line
    assert "holds ['head.wEight'], which metadata.pkl does not place there" in line


@slow
def test_an_unfinalized_save_converts_with_a_warning(
    tc_save: Save, tc_root: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A save is written into `tmp_step_N/` and renamed when every rank has finished."""
    step = tmp_path / "tmp_step_1"
    shutil.copytree(tc_save("pt"), step)
    summary = convert(capsys, step, tmp_path / "out")
    assert any("was not finalized" in w for w in summary["warnings"]), summary["warnings"]
    got = load_file(tmp_path / "out" / "model.safetensors")
    live = load_file(tc_root / "live.safetensors")
    assert all(torch.equal(t, live[n]) for n, t in got.items())


@slow
def test_a_dim1_shard_is_refused_with_torch_checkpointings_own_way_out(
    tc_save: Save, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    line = refused(capsys, tc_save("shard1"), tmp_path / "out")
    assert "placements ['Shard(1)']" in line and "CheckpointManager.load" in line
    assert "verl" not in line


def _touch(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def test_a_missing_model_rank_is_refused_from_the_listing_alone(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The other items' files name the world size; no file is opened (they are empty)."""
    step = _touch(tmp_path / "step_3", "model_0.pt", "model_2.pt", "optim_0.pt", "optim_3.pt")
    assert detect_format(Storage(), str(step)).name == "torch_checkpointing"
    line = refused(capsys, step, tmp_path / "out")
    assert "model_R.pt for R = 0..3" in line and "model_1.pt, model_3.pt are missing" in line


def test_other_formats_keep_their_folders(tmp_path: Path) -> None:
    storage = Storage()
    verl = _touch(
        tmp_path / "actor", "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"
    )
    assert detect_format(storage, str(verl)).name == "verl"
    accelerate = _touch(tmp_path / "acc", "model.safetensors", "model_1.safetensors")
    assert detect_format(storage, str(accelerate)).name != "torch_checkpointing"


@pytest.mark.parametrize(
    ("mesh", "placements"),
    [((4,), (0,)), ((4,), (None,)), ((2, 3), (0, 1)), ((2, 2), (0, 0)), ((3, 2), (None, 1))],
)
def test_a_shards_box_is_torch_chunks_piece_of_its_coordinate(
    mesh: tuple[int, ...], placements: tuple[int | None, ...]
) -> None:
    """DTensor's rule: each `Shard(d)` splits the rank's current extent of dim d into
    `torch.chunk`'s pieces, in mesh dimension order (a missing piece is empty)."""
    shape = (10, 7)
    sharded = ShardedTensor(
        global_shape=shape, dtype="float32", mesh_shape=mesh,
        mesh_ranks=tuple(range(math.prod(mesh))),
        placements=tuple(Placement(dim=d) for d in placements), ranks=(),
    )  # fmt: skip
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        index = [torch.arange(n) for n in shape]
        for dim, parts, at in zip(placements, mesh, coordinate, strict=True):
            if dim is not None:
                pieces = torch.chunk(index[dim], parts)
                index[dim] = pieces[at] if at < len(pieces) else index[dim][:0]
        offsets, sizes = local_box(sharded, coordinate)
        assert sizes == tuple(len(i) for i in index), coordinate
        assert all(not len(i) or o == int(i[0]) for o, i in zip(offsets, index, strict=True))
