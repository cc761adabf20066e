"""`file_sha256` (`--file-sha256`): each weight file's SHA-256 in the manifest, as the Hugging
Face Hub records it for an uploaded file, hashed by verify's own re-read; `zerosafe verify`
checks it where it is recorded; a rerun asking for it on an output converted without it adds
it without converting again.

The sample ZeRO-3 checkpoint is converted twice per session (with and without the option,
five small shards each); each test works on a fresh copy.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest

from tests.conftest import SAMPLE_CKPT
from tests.verify.test_output import fails, fix_marker, zerosafe_cli
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.verify.output import verify_output

MANIFEST = "zerosafe-manifest.json"
FIVE_SHARDS = 20_000

pytestmark = pytest.mark.timeout(60)


def _convert(out: Path, **options: object) -> str:
    summary = convert_checkpoint(
        str(SAMPLE_CKPT), str(out), ConvertOptions(max_shard_size=FIVE_SHARDS, **options)
    )
    return summary.status


@pytest.fixture(scope="session")
def with_sums(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sha-on") / "out"
    _convert(out, file_sha256=True)
    return out


@pytest.fixture(scope="session")
def without_sums(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sha-off") / "out"
    _convert(out)
    return out


@pytest.fixture
def out(with_sums: Path, tmp_path: Path) -> Path:
    """A fresh, writable copy of the output converted with `file_sha256`."""
    return Path(shutil.copytree(with_sums, tmp_path / "out"))


def _manifest(out: Path) -> dict[str, object]:
    manifest: dict[str, object] = json.loads((out / MANIFEST).read_text())
    return manifest


def _file_entries(out: Path) -> list[dict[str, object]]:
    files = _manifest(out)["files"]
    assert isinstance(files, list) and len(files) == 5
    return files


def _sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _weight_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("model*"))}


def _respace_header_padding(path: Path) -> None:
    """Turn the header's last byte, a padding space, into a tab: the same JSON, the same
    tensors and metadata, so no per-tensor checksum changes; only the file's bytes do."""
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    assert raw[8 + length - 1 : 8 + length] == b" ", "no padding space at the header's end"
    raw[8 + length - 1] = ord("\t")
    path.write_bytes(bytes(raw))


def test_recorded_sha256_is_the_sha256_of_each_file_on_disk(with_sums: Path) -> None:
    for entry in _file_entries(with_sums):
        assert entry["sha256"] == _sha256_of(with_sums / str(entry["file"])), entry["file"]
    report = verify_output(str(with_sums))
    assert report["ok"], report["failures"]
    assert len(report["file_sha256"]) == 5


def test_off_records_nothing_and_writes_the_same_bytes(with_sums: Path, without_sums: Path) -> None:
    assert all("sha256" not in entry for entry in _file_entries(without_sums))
    assert _weight_files(without_sums) == _weight_files(with_sums)  # shards and index
    report = verify_output(str(without_sums))
    assert report["ok"] and report["file_sha256"] == {}, report["failures"]


def test_verify_catches_a_change_only_the_whole_file_sha256_sees(out: Path) -> None:
    shard = "model-00002-of-00005.safetensors"
    _respace_header_padding(out / shard)

    report = verify_output(str(out))
    assert [(f["file"], f["check"]) for f in report["failures"]] == [(shard, "sha256")]
    assert "changed since it was published" in fails(report, "sha256")[0]["detail"]

    r = zerosafe_cli("verify", out)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith("FAILED")
    assert any(shard in line and "sha256" in line for line in r.stdout.splitlines())


def test_the_same_change_passes_an_old_manifest_without_the_field(out: Path) -> None:
    """Without the recorded sums (a manifest of an earlier version, or converted without the
    option) the output still verifies, and the per-tensor checksums alone do not see the
    change above: the reason for the whole-file hash."""
    manifest = _manifest(out)
    for entry in manifest["files"]:  # type: ignore[attr-defined]
        del entry["sha256"]
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    fix_marker(out)
    assert verify_output(str(out))["ok"]

    _respace_header_padding(out / "model-00002-of-00005.safetensors")
    report = verify_output(str(out))
    assert report["ok"] and report["file_sha256"] == {}, report["failures"]


def test_rerun_with_the_option_adds_the_sums_without_converting_again(
    without_sums: Path, tmp_path: Path
) -> None:
    out = Path(shutil.copytree(without_sums, tmp_path / "out"))
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("model-*")}
    job_key = _manifest(out)["job_key"]

    assert _convert(out, file_sha256=True) == "converted"  # published shards only verified
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("model-*")}
    assert after == before  # not rewritten
    assert _manifest(out)["job_key"] == job_key
    for entry in _file_entries(out):
        assert entry["sha256"] == _sha256_of(out / str(entry["file"]))
    assert verify_output(str(out))["ok"]

    assert _convert(out, file_sha256=True) == "already-complete"
    assert _convert(out) == "already-complete"  # off does not drop the recorded sums
    assert all("sha256" in entry for entry in _file_entries(out))
