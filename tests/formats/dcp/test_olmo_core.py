"""OLMo-core checkpoints (issue 26): `stepN/model_and_optim/` as OLMo-core's own
`save_model_and_optim_state` writes it, converted bit-exact against the live model's state
dict, under OLMo-core's own tensor names, with the optimizer state never read and OLMo-core's
experiment `config.json` not copied as a transformers config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.formats.dcp.helpers import same_bits
from zerosafe.formats.dcp.metadata import parse_metadata
from zerosafe_app.cli import main

pytestmark = pytest.mark.slow

OLMO_STORAGE_INFO = "olmo_core.distributed.checkpoint.filesystem._StorageInfo"


def _convert(
    capsys: pytest.CaptureFixture[str], src: Path, out: Path, *args: str
) -> dict[str, object]:
    code = main(["convert", str(src), str(out), "--via", "local", "--json", *args])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    return dict(json.loads(stdout))


def _output(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _assert_live(out: Path, olmo_core_root: Path, dtype: torch.dtype = torch.float32) -> None:
    live = load_file(olmo_core_root / "live.safetensors")
    got = _output(out)
    # OLMo-core's names in its state_dict() order, nothing added or renamed
    assert list(got) == json.loads((olmo_core_root / "live_names.json").read_text())
    assert "embeddings.weight" in got and "lm_head.w_out.weight" in got
    for name, ref in live.items():
        assert same_bits(got[name], ref.to(dtype)), name


def test_metadata_reads_olmo_core_storage_info(olmo_core_root: Path) -> None:
    path = olmo_core_root / "step3" / "model_and_optim" / ".metadata"
    meta = parse_metadata(path.read_bytes(), str(path))
    assert OLMO_STORAGE_INFO in meta.globals_found
    assert meta.writers == ("OLMo-core's RemoteFileSystemWriter",)
    assert meta.written_by_olmo_core and meta.version is None  # OLMo-core sets no version
    assert {k.split(".", 1)[0] for k in meta.tensors} == {"model", "optim"}
    # every chunk lies in a __R_N.distcp file of the folder, inside the file
    files = {p.name: p.stat().st_size for p in path.parent.glob("*.distcp")}
    for info in meta.storage.values():
        assert info.offset + info.length <= files[info.relative_path]
        assert info.transform_descriptors == ()


@pytest.mark.parametrize(
    ("dtype", "torch_dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)]
)
def test_convert_model_and_optim_matches_live_weights(
    dtype: str,
    torch_dtype: torch.dtype,
    olmo_core_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = olmo_core_root / "step3" / "model_and_optim"
    summary = _convert(capsys, src, tmp_path / "out", "--dtype", dtype)
    _assert_live(tmp_path / "out", olmo_core_root, torch_dtype)
    # OLMo-core's experiment config is not a transformers config: said, and not copied
    assert not (tmp_path / "out" / "config.json").exists()
    warnings = " ".join(map(str, summary["warnings"]))  # type: ignore[call-overload]
    assert "OLMo-core's experiment config" in warnings and "not copied" in warnings
    manifest = json.loads((tmp_path / "out" / "zerosafe-manifest.json").read_text())
    assert manifest["source"]["writers"] == ["OLMo-core's RemoteFileSystemWriter"]
    assert manifest["source"]["strip_prefix"] == "model"
    assert manifest["model_files"] == []
    assert main(["verify", str(tmp_path / "out"), "--against", str(src)]) == 0
    assert "source same contents" in capsys.readouterr().out


def test_inspect_says_what_is_read(
    olmo_core_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["inspect", str(olmo_core_root / "step3" / "model_and_optim")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "written by: OLMo-core's RemoteFileSystemWriter" in out
    assert "not selected and never read (top-level keys ['optim'])" in out
    assert "tensors keep OLMo-core's own names" in out


def test_convert_step_folder(
    olmo_core_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = _convert(capsys, olmo_core_root / "step3", tmp_path / "out")
    _assert_live(tmp_path / "out", olmo_core_root)
    assert not (tmp_path / "out" / "config.json").exists()
    assert "model_and_optim (the only save in" in json.dumps(summary)
