"""The output's records (`zerosafe.stages.manifest`): a published manifest reads back into a
`Manifest` and writes back byte for byte; manifests of earlier versions, without the keys
added since, still read (and say what they lack)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SAMPLE_CKPT
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import OutputExistsError
from zerosafe.io.storage import Storage
from zerosafe.stages.manifest import Manifest, Marker
from zerosafe.stages.output import (
    MANIFEST_NAME,
    MARKER_NAME,
    inspect_output,
    lacks_file_sha256,
    read_complete_manifest,
)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample converted into shards with an index, copied model files and file SHA-256s."""
    root = tmp_path_factory.mktemp("manifest")
    model_files = root / "model"
    model_files.mkdir()
    (model_files / "config.json").write_text('{"model_type": "llama"}\n')
    (model_files / "tokenizer_config.json").write_text("{}\n")
    out = root / "out"
    options = ConvertOptions(max_shard_size=4096, file_sha256=True, model_files=str(model_files))
    convert_checkpoint(str(SAMPLE_CKPT), str(out), options)
    return out


def test_a_published_manifest_reads_back_and_writes_the_same_bytes(published: Path) -> None:
    raw = (published / MANIFEST_NAME).read_text()
    manifest = Manifest.from_json(json.loads(raw))
    assert json.dumps(manifest.to_json(), indent=1) + "\n" == raw
    assert manifest.index is not None and len(manifest.files) > 1
    assert [e.file for e in manifest.model_files] == ["config.json", "tokenizer_config.json"]
    assert all(e.version is not None for e in manifest.model_files)
    assert not lacks_file_sha256(manifest) and manifest.stats is not None
    assert manifest.source is not None and manifest.source.checkpoint == str(SAMPLE_CKPT)
    marker = Marker.from_json(json.loads((published / MARKER_NAME).read_text()))
    assert marker.job_key == manifest.job_key
    assert read_complete_manifest(Storage(), str(published)) == manifest


def test_an_earlier_versions_manifest_still_reads(published: Path) -> None:
    """Before files had versions and SHA-256s, model files were copied, `keep_work` and
    `checks` were recorded: such a manifest reads, with what it lacks at the values the code
    always took for them."""
    data = json.loads((published / MANIFEST_NAME).read_text())
    for key in ("model_files", "model_files_from", "keep_work", "index", "checks"):
        del data[key]
    for entry in data["files"]:
        del entry["version"], entry["sha256"]
    old = Manifest.from_json(data)
    assert old.keep_work and old.model_files == () and old.model_files_from is None
    assert lacks_file_sha256(old) and old.index is None and old.checks.verified_tensors == 0
    assert json.loads(json.dumps(old.to_json()))["files"][0].keys() == {
        "file", "size_bytes", "data_bytes", "version",
    }  # fmt: skip


def test_a_vouched_manifest_that_is_no_manifest_is_refused_in_one_line(
    published: Path, tmp_path: Path
) -> None:
    import hashlib
    import shutil

    out = tmp_path / "out"
    shutil.copytree(published, out)
    raw = b'{"files": [{"file": "model.safetensors"}]}\n'
    (out / MANIFEST_NAME).write_bytes(raw)
    marker = {"job_key": "k", "manifest_sha256": hashlib.sha256(raw).hexdigest()}
    (out / MARKER_NAME).write_text(json.dumps(marker))
    with pytest.raises(OutputExistsError, match="ShardEntry: expected the key 'size_bytes'"):
        read_complete_manifest(Storage(), str(out))
    assert inspect_output(Storage(), str(out), "k").kind == "unusable"
