"""`zerosafe verify`: every corruption of a written output is caught and named.

Each test converts nothing itself: two session fixtures convert the sample ZeRO-3 checkpoint
once (fp32 in five small shards, fp16 in one file) and every test corrupts a fresh copy, then
checks that `verify_output` (and, where it matters, the CLI) reports the failing file, the
tensor and the check. Corruptions are made at the byte level (from the safetensors header:
8-byte little-endian length N, N bytes of JSON, data offsets relative to byte 8+N) or by
rewriting a file with the `safetensors` library.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import CheckpointFormatError
from zerosafe.verify.output import verify_output

REPO = Path(__file__).resolve().parents[2]
CKPT = REPO / "examples" / "zero3-bf16-ws3"
INDEX = "model.safetensors.index.json"
MANIFEST = "zerosafe-manifest.json"
MARKER = "zerosafe-complete.json"
SHARD1 = "model-00001-of-00005.safetensors"
SHARD2 = "model-00002-of-00005.safetensors"
SHARD5 = "model-00005-of-00005.safetensors"

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample checkpoint converted once: fp32, five shards, manifest and marker."""
    out = tmp_path_factory.mktemp("verify-src") / "out"
    convert_checkpoint(str(CKPT), str(out), ConvertOptions(max_shard_size=20_000))
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == [
        f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)
    ], "the sample no longer converts to five shards; update the shard names in this file"
    return out


@pytest.fixture(scope="session")
def converted_fp16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verify-src-fp16") / "out"
    convert_checkpoint(str(CKPT), str(out), ConvertOptions(dtype="fp16"))
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        if p.is_dir():  # leftovers of the work folder, if the engine keeps any
            shutil.rmtree(p)
    return dst


@pytest.fixture
def out(converted: Path, tmp_path: Path) -> Path:
    """A fresh, writable copy of the five-shard output."""
    return _copy(converted, tmp_path / "out")


@pytest.fixture
def out16(converted_fp16: Path, tmp_path: Path) -> Path:
    return _copy(converted_fp16, tmp_path / "out16")


# --------------------------------------------------------------------------- helpers


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(tensor entries, data_start) of a safetensors file, parsed by hand."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Absolute [begin, end) of a tensor's bytes in its file."""
    header, data_start = read_header(path)
    begin, end = header[name]["data_offsets"]
    return data_start + begin, data_start + end


def patch_bytes(path: Path, offset: int, new: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(new)


def load_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def save_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def rewrite_tensor(path: Path, name: str, fn: Any) -> None:
    """Rewrite `path` with `name` replaced by fn(tensor); other tensors and metadata kept."""
    tensors, metadata = load_shard(path)
    tensors[name] = fn(tensors[name].clone())
    save_shard(path, tensors, metadata)


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2))


def fix_marker(out: Path) -> None:
    """Make the completion marker vouch for the (edited) manifest again."""
    marker = load_json(out / MARKER)
    marker["manifest_sha256"] = hashlib.sha256((out / MANIFEST).read_bytes()).hexdigest()
    dump_json(out / MARKER, marker)


def drop_manifest(out: Path) -> None:
    (out / MANIFEST).unlink()
    (out / MARKER).unlink()


def fix_total_size(out: Path) -> None:
    index = load_json(out / INDEX)
    total = 0
    for f in set(index["weight_map"].values()):
        if (out / f).exists():
            header, _ = read_header(out / f)
            total += sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
    index["metadata"]["total_size"] = total
    dump_json(out / INDEX, index)


def fails(
    report: dict[str, Any],
    check: str | None = None,
    *,
    tensor: str | None = None,
    file: str | None = None,
) -> list[dict[str, str]]:
    """The report's failures matching every given field (file: substring match)."""
    return [
        f
        for f in report["failures"]
        if (check is None or f["check"] == check)
        and (tensor is None or f["tensor"] == tensor)
        and (file is None or file in f["file"])
    ]


def checks(report: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(f["file"], f["tensor"], f["check"]) for f in report["failures"]}


def zerosafe_cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("zerosafe")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "zerosafe_app.cli"]
    return subprocess.run(
        [*cmd, *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def nan_byte_position(path: Path, name: str) -> tuple[int, int]:
    """(offset, new byte) such that writing that one byte turns one float32 of `name` into NaN.

    float32 little-endian: byte 3 = sign + 7 high exponent bits, byte 2 = the low exponent bit
    + 7 mantissa bits. Choose an element whose low exponent bit is set and whose mantissa is
    not zero; setting byte 3 to 0x7F then makes the exponent all ones: NaN.
    """
    begin, end = tensor_span(path, name)
    raw = path.read_bytes()[begin:end]
    for i in range(0, len(raw), 4):
        b0, b1, b2, _ = raw[i : i + 4]
        if b2 & 0x80 and (b2 & 0x7F or b1 or b0):
            return begin + i + 3, 0x7F
    raise AssertionError(f"no element of {name} suits a one-byte NaN")


# --------------------------------------------------------------------------- 1. clean


def test_untouched_output_passes_cli_and_api(out: Path) -> None:
    r = zerosafe_cli("verify", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("OK")
    assert "manifest checksums compared" in r.stdout
    assert "lm_head.weight -> embed.weight" in r.stdout

    report = verify_output(str(out))
    assert report["ok"], report["failures"]
    assert report["has_manifest"] and report["complete"]
    assert report["num_tensors"] == 20
    assert len(report["files"]) == 5
    assert report["aliases"] == {"lm_head.weight": "embed.weight"}
    assert report["nonfinite"] == {}


def test_untouched_output_passes_against_checkpoint(out: Path) -> None:
    r = zerosafe_cli("verify", out, "--against", CKPT, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and report["failures"] == []
    assert report["against"]["tag"] == "global_step2"
    assert report["against"]["expected_tensors"] == 20

    report = verify_output(str(out), against=str(CKPT))
    assert report["ok"], report["failures"]


def test_single_file_output_passes(converted_fp16: Path) -> None:
    report = verify_output(str(converted_fp16), against=str(CKPT))
    assert report["ok"], report["failures"]
    assert report["files"] == ["model.safetensors"]


# --------------------------------------------------------------------------- 2. one flipped byte


@pytest.mark.parametrize(
    "shard,tensor", [(SHARD2, "blocks.0.up.weight"), (SHARD5, "side.bias"), (SHARD1, "step_count")]
)
def test_flipped_byte_is_a_checksum_failure_naming_the_tensor(
    out: Path, shard: str, tensor: str
) -> None:
    begin, end = tensor_span(out / shard, tensor)
    pos = (begin + end) // 2
    old = (out / shard).read_bytes()[pos]
    patch_bytes(out / shard, pos, bytes([old ^ 0x01]))  # lowest mantissa bit: stays finite

    report = verify_output(str(out))
    assert not report["ok"]
    assert checks(report) == {(shard, tensor, "checksum")}
    assert "recorded" in fails(report, "checksum")[0]["detail"]

    r = zerosafe_cli("verify", out) if shard == SHARD2 else None
    if r is not None:
        assert r.returncode == 1
        assert r.stdout.startswith("FAILED")
        row = next(line for line in r.stdout.splitlines() if tensor in line and "checksum" in line)
        assert shard in row


def test_flipped_byte_without_manifest_making_nan_is_a_finite_failure(out: Path) -> None:
    drop_manifest(out)
    shard, tensor = SHARD2, "blocks.0.up.weight"
    pos, byte = nan_byte_position(out / shard, tensor)
    patch_bytes(out / shard, pos, bytes([byte]))

    report = verify_output(str(out))
    assert not report["has_manifest"]
    assert checks(report) == {(shard, tensor, "finite")}
    assert fails(report)[0]["detail"].startswith("1 NaN")
    assert report["nonfinite"] == {tensor: {"nan": 1, "posinf": 0, "neginf": 0}}


# --------------------------------------------------------------------------- 3. truncated


@pytest.mark.parametrize("cut", [1, 3, 100])
def test_truncated_shard_is_named(out: Path, cut: int) -> None:
    path = out / SHARD2
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - cut)

    report = verify_output(str(out))
    assert not report["ok"]
    header = fails(report, "header", file=SHARD2)
    assert header, report["failures"]
    assert header[0]["file"] == SHARD2 and header[0]["tensor"] == "*"
    assert "truncated" in header[0]["detail"]
    # nothing else is blamed on the other shards
    assert all(f["file"] in (SHARD2, INDEX) for f in report["failures"]), report["failures"]


def test_truncated_header_is_named(out: Path) -> None:
    with open(out / SHARD5, "r+b") as f:
        f.truncate(50)
    report = verify_output(str(out))
    header = fails(report, "header", file=SHARD5)
    assert header and "truncated" in header[0]["detail"]


# --------------------------------------------------------------------------- 4. index


def test_tensor_dropped_from_index_is_named(out: Path) -> None:
    index = load_json(out / INDEX)
    del index["weight_map"]["blocks.0.norm.bias"]
    dump_json(out / INDEX, index)

    report = verify_output(str(out))
    assert checks(report) == {(SHARD2, "blocks.0.norm.bias", "indexed")}
    assert "not listed" in fails(report)[0]["detail"]


def test_index_pointing_to_the_wrong_shard_is_named(out: Path) -> None:
    index = load_json(out / INDEX)
    index["weight_map"]["blocks.0.norm.bias"] = SHARD5
    dump_json(out / INDEX, index)

    report = verify_output(str(out))
    assert checks(report) == {(SHARD5, "blocks.0.norm.bias", "indexed")}


# --------------------------------------------------------------------------- 5. duplicate


@pytest.mark.parametrize("with_manifest", [True, False])
def test_tensor_duplicated_across_shards_is_a_unique_failure(
    out: Path, with_manifest: bool
) -> None:
    if not with_manifest:
        drop_manifest(out)
    first, _ = load_shard(out / SHARD1)
    tensors, metadata = load_shard(out / SHARD2)
    tensors["embed.weight"] = first["embed.weight"]
    save_shard(out / SHARD2, tensors, metadata)
    fix_total_size(out)  # the index keeps embed.weight -> shard 1; only the duplicate is wrong

    report = verify_output(str(out))
    unique = fails(report, "unique", tensor="embed.weight")
    assert len(unique) == 1, report["failures"]
    assert SHARD1 in unique[0]["file"] and SHARD2 in unique[0]["file"]
    assert "2 files" in unique[0]["detail"]
    if with_manifest:
        assert checks(report) == {
            (unique[0]["file"], "embed.weight", "unique"),
            (SHARD2, "embed.weight", "present"),  # "not expected in this file"
        }
    else:
        assert checks(report) == {(unique[0]["file"], "embed.weight", "unique")}


def test_cli_table_names_both_files_of_a_duplicate(out: Path) -> None:
    drop_manifest(out)
    first, _ = load_shard(out / SHARD1)
    tensors, metadata = load_shard(out / SHARD2)
    tensors["embed.weight"] = first["embed.weight"]
    save_shard(out / SHARD2, tensors, metadata)
    fix_total_size(out)
    r = zerosafe_cli("verify", out)
    assert r.returncode == 1
    row = next(line for line in r.stdout.splitlines() if "unique" in line)
    assert SHARD1 in row and SHARD2 in row, row


# --------------------------------------------------------------------------- 6. swapped


def test_swapped_same_size_tensors_are_both_checksum_failures(out: Path) -> None:
    a, b = "blocks.0.up.bias", "blocks.0.norm.weight"
    tensors, metadata = load_shard(out / SHARD2)
    assert tensors[a].shape == tensors[b].shape and not torch.equal(tensors[a], tensors[b])
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_shard(out / SHARD2, tensors, metadata)

    report = verify_output(str(out))
    assert checks(report) == {(SHARD2, a, "checksum"), (SHARD2, b, "checksum")}


def test_swapped_tensors_across_shards_are_both_checksum_failures(out: Path) -> None:
    # same shape [40, 67] in shard 3 and shard 5: swapping across files
    shard3 = "model-00003-of-00005.safetensors"
    a, b = "blocks.0.down.weight", "blocks.1.down.weight"
    t3, m3 = load_shard(out / shard3)
    t5, m5 = load_shard(out / SHARD5)
    t3[a], t5[b] = t5[b], t3[a]
    save_shard(out / shard3, t3, m3)
    save_shard(out / SHARD5, t5, m5)

    report = verify_output(str(out))
    assert checks(report) == {(shard3, a, "checksum"), (SHARD5, b, "checksum")}


# --------------------------------------------------------------------------- 7. NaN


def test_nan_written_into_a_tensor_is_a_finite_failure(out: Path) -> None:
    tensor = "final_norm.weight"

    def poison(t: torch.Tensor) -> torch.Tensor:
        t[3] = float("nan")
        t[7] = float("-inf")
        return t

    rewrite_tensor(out / SHARD5, tensor, poison)
    report = verify_output(str(out))
    assert checks(report) == {(SHARD5, tensor, "finite"), (SHARD5, tensor, "checksum")}
    assert fails(report, "finite")[0]["detail"] == "1 NaN, 0 +Inf, 1 -Inf"
    assert report["nonfinite"] == {tensor: {"nan": 1, "posinf": 0, "neginf": 1}}

    # --allow-nonfinite / allow_nonfinite=True: the finiteness check passes; the manifest still
    # recorded other bytes, so the checksum check still fails
    report = verify_output(str(out), allow_nonfinite=True)
    assert checks(report) == {(SHARD5, tensor, "checksum")}
    assert report["nonfinite"][tensor]["nan"] == 1  # counted either way

    r = zerosafe_cli("verify", out, "--allow-nonfinite", "--json")
    assert r.returncode == 1
    assert {(f["tensor"], f["check"]) for f in json.loads(r.stdout)["failures"]} == {
        (tensor, "checksum")
    }


def test_nan_allowed_without_manifest_passes(out: Path) -> None:
    drop_manifest(out)
    tensor = "final_norm.weight"
    rewrite_tensor(out / SHARD5, tensor, lambda t: t.fill_(float("nan")))

    report = verify_output(str(out))
    assert checks(report) == {(SHARD5, tensor, "finite")}
    assert fails(report)[0]["detail"].startswith("40 NaN")

    report = verify_output(str(out), allow_nonfinite=True)
    assert report["ok"], report["failures"]
    assert report["nonfinite"] == {tensor: {"nan": 40, "posinf": 0, "neginf": 0}}


# --------------------------------------------------------------------------- 8. fp16 overflow


def test_fp16_inf_is_reported_as_float16_overflow(out16: Path) -> None:
    path = out16 / "model.safetensors"
    tensors, _ = load_shard(path)
    assert tensors["embed.weight"].dtype == torch.float16
    rewrite_tensor(
        path,
        "embed.weight",
        lambda t: t.view(-1).index_fill_(0, torch.tensor([0, 5]), float("inf")).view_as(t),
    )

    report = verify_output(str(out16))
    finite = fails(report, "finite")
    assert [(f["file"], f["tensor"]) for f in finite] == [("model.safetensors", "embed.weight")]
    assert finite[0]["detail"].startswith("0 NaN, 2 +Inf, 0 -Inf")
    assert "float16 overflow" in finite[0]["detail"]

    # an fp32 Inf is not blamed on fp16
    drop_manifest(out16)
    rewrite_tensor(path, "embed.weight", lambda t: t.float())
    report = verify_output(str(out16))
    finite = fails(report, "finite", tensor="embed.weight")
    assert finite and "overflow" not in finite[0]["detail"]


# --------------------------------------------------------------------------- 9. files


def test_missing_shard_is_named(out: Path) -> None:
    (out / SHARD2).unlink()
    report = verify_output(str(out))
    present = fails(report, "present", file=SHARD2)
    assert any(
        f["file"] == SHARD2 and f["tensor"] == "*" and "missing" in f["detail"] for f in present
    ), report["failures"]
    # no other shard is blamed, nor any tensor of another shard
    assert {f["file"] for f in report["failures"]} <= {SHARD2, INDEX}


def test_stray_shard_not_in_the_index_is_named(out: Path) -> None:
    stray = "model-00001-of-00007.safetensors"  # left over from an earlier run
    shutil.copy(out / SHARD2, out / stray)
    report = verify_output(str(out))
    assert (stray, "*", "indexed") in checks(report)
    assert not any(
        f["file"].startswith("model-0000") and f["file"] != stray for f in report["failures"]
    )


def test_no_completion_marker_is_a_complete_failure(out: Path) -> None:
    (out / MARKER).unlink()
    report = verify_output(str(out))
    assert report["complete"] is False
    assert checks(report) == {(MARKER, "*", "complete")}
    assert "did not finish" in fails(report)[0]["detail"]


def test_marker_not_matching_the_manifest_is_a_complete_failure(out: Path) -> None:
    marker = load_json(out / MARKER)
    marker["manifest_sha256"] = "0" * 64
    dump_json(out / MARKER, marker)
    report = verify_output(str(out))
    assert checks(report) == {(MARKER, "*", "complete")}
    assert "does not match" in fails(report)[0]["detail"]


@pytest.mark.parametrize("delta", [1, -4, 10_000])
def test_wrong_total_size_is_named(out: Path, delta: int) -> None:
    index = load_json(out / INDEX)
    right = index["metadata"]["total_size"]
    index["metadata"]["total_size"] = right + delta
    dump_json(out / INDEX, index)
    report = verify_output(str(out))
    assert checks(report) == {(INDEX, "*", "total_size")}
    assert (
        str(right + delta) in fails(report)[0]["detail"]
        and str(right) in fails(report)[0]["detail"]
    )


def test_tensor_removed_but_still_in_the_manifest_is_named(out: Path) -> None:
    tensor = "blocks.0.up.bias"
    tensors, metadata = load_shard(out / SHARD2)
    del tensors[tensor]
    save_shard(out / SHARD2, tensors, metadata)
    index = load_json(out / INDEX)
    del index["weight_map"][tensor]
    dump_json(out / INDEX, index)
    fix_total_size(out)
    report = verify_output(str(out))
    assert checks(report) == {(SHARD2, tensor, "present")}
    assert "missing from the file" in fails(report)[0]["detail"]


def test_shard_removed_from_disk_and_index_but_in_the_manifest_is_named(out: Path) -> None:
    gone = [t for t, f in load_json(out / INDEX)["weight_map"].items() if f == SHARD5]
    (out / SHARD5).unlink()
    index = load_json(out / INDEX)
    index["weight_map"] = {t: f for t, f in index["weight_map"].items() if f != SHARD5}
    dump_json(out / INDEX, index)
    fix_total_size(out)
    report = verify_output(str(out))
    assert not report["ok"]
    named = {f["tensor"] for f in report["failures"] if SHARD5 in f["file"]} | {
        f["file"] for f in report["failures"]
    }
    assert SHARD5 in named or set(gone) <= named, report["failures"]


def test_stray_single_file_beside_the_index_is_named(out: Path) -> None:
    shutil.copy(out / SHARD2, out / "model.safetensors")
    report = verify_output(str(out))
    assert any(f["file"] == "model.safetensors" for f in report["failures"]), report["failures"]


def test_marker_without_its_manifest_is_a_complete_failure(out: Path) -> None:
    (out / MANIFEST).unlink()
    report = verify_output(str(out))
    assert not report["ok"]
    assert any(MANIFEST in f["file"] or MARKER in f["file"] for f in report["failures"]), report[
        "failures"
    ]


# --------------------------------------------------------------------------- 10. tied


def test_index_alias_to_a_missing_target_is_a_tied_failure(out: Path) -> None:
    index = load_json(out / INDEX)
    index["metadata"]["aliases"] = {"lm_head.weight": "embed.weight.gone"}
    dump_json(out / INDEX, index)
    report = verify_output(str(out))
    # the index disagrees with the manifest about the alias's target: named where it is recorded
    assert checks(report) == {(INDEX, "lm_head.weight", "tied")}
    assert "embed.weight.gone" in fails(report)[0]["detail"]


def test_manifest_alias_to_a_missing_target_is_a_tied_failure(out: Path) -> None:
    manifest = load_json(out / MANIFEST)
    manifest["aliases"]["head2.weight"] = "not.stored"
    dump_json(out / MANIFEST, manifest)
    fix_marker(out)
    report = verify_output(str(out))
    assert checks(report) == {(MANIFEST, "head2.weight", "tied")}


def test_alias_whose_target_tensor_was_removed_is_a_tied_failure(out: Path) -> None:
    # embed.weight gone from shard 1 and the index: the alias lm_head.weight -> embed.weight dangles
    drop_manifest(out)
    tensors, metadata = load_shard(out / SHARD1)
    del tensors["embed.weight"]
    save_shard(out / SHARD1, tensors, metadata)
    index = load_json(out / INDEX)
    del index["weight_map"]["embed.weight"]
    dump_json(out / INDEX, index)
    fix_total_size(out)
    report = verify_output(str(out))
    # every place that records the alias names the missing target
    assert {c for c in checks(report) if c[2] == "tied"} == {
        (f, "lm_head.weight", "tied") for f in (SHARD1, INDEX)
    }  # manifest dropped above


def test_alias_also_listed_in_the_weight_map_is_a_tied_failure(out: Path) -> None:
    index = load_json(out / INDEX)
    index["weight_map"]["lm_head.weight"] = SHARD1
    dump_json(out / INDEX, index)
    report = verify_output(str(out))
    tied = fails(report, "tied", tensor="lm_head.weight")
    assert tied and "loaders would look for it" in tied[0]["detail"]


def test_manifest_alias_disagreeing_with_the_index_is_a_tied_failure(out: Path) -> None:
    manifest = load_json(out / MANIFEST)
    manifest["aliases"]["lm_head.weight"] = "not.stored"
    dump_json(out / MANIFEST, manifest)
    fix_marker(out)
    report = verify_output(str(out))
    assert fails(report, "tied", tensor="lm_head.weight"), report["failures"]


# --------------------------------------------------------------------------- 11. --against


def test_tensor_removed_entirely_is_a_coverage_failure(out: Path) -> None:
    tensor = "side.bias"  # a frozen parameter
    tensors, metadata = load_shard(out / SHARD5)
    del tensors[tensor]
    save_shard(out / SHARD5, tensors, metadata)
    index = load_json(out / INDEX)
    del index["weight_map"][tensor]
    dump_json(out / INDEX, index)
    fix_total_size(out)
    manifest = load_json(out / MANIFEST)
    del manifest["tensors"][tensor]
    dump_json(out / MANIFEST, manifest)
    fix_marker(out)

    assert verify_output(str(out))["ok"], "without --against the output is self-consistent"
    report = verify_output(str(out), against=str(CKPT))
    assert checks(report) == {("*", tensor, "coverage")}
    assert "not in the output" in fails(report)[0]["detail"]

    r = zerosafe_cli("verify", out, "--against", CKPT)
    assert r.returncode == 1
    assert any(tensor in line and "coverage" in line for line in r.stdout.splitlines())


def test_buffer_removed_entirely_is_a_coverage_failure(out: Path) -> None:
    drop_manifest(out)
    tensor = "step_count"
    tensors, metadata = load_shard(out / SHARD1)
    del tensors[tensor]
    save_shard(out / SHARD1, tensors, metadata)
    index = load_json(out / INDEX)
    del index["weight_map"][tensor]
    dump_json(out / INDEX, index)
    fix_total_size(out)
    report = verify_output(str(out), against=str(CKPT))
    assert checks(report) == {("*", tensor, "coverage")}


def test_tied_alias_forgotten_is_a_coverage_failure(out: Path) -> None:
    drop_manifest(out)
    index = load_json(out / INDEX)
    del index["metadata"]["aliases"]
    dump_json(out / INDEX, index)
    tensors, metadata = load_shard(out / SHARD1)
    del metadata["aliases"]
    save_shard(out / SHARD1, tensors, metadata)
    assert verify_output(str(out))["ok"]
    report = verify_output(str(out), against=str(CKPT))
    assert checks(report) == {("*", "lm_head.weight", "coverage")}


def test_extra_tensor_and_wrong_shape_are_coverage_failures(out: Path) -> None:
    drop_manifest(out)
    tensors, metadata = load_shard(out / SHARD5)
    tensors["stray.weight"] = torch.zeros(3)
    tensors["side.bias"] = torch.zeros(14)
    save_shard(out / SHARD5, tensors, metadata)
    index = load_json(out / INDEX)
    index["weight_map"]["stray.weight"] = SHARD5
    dump_json(out / INDEX, index)
    fix_total_size(out)
    assert verify_output(str(out))["ok"]
    report = verify_output(str(out), against=str(CKPT))
    assert checks(report) == {
        (SHARD5, "stray.weight", "coverage"),
        (SHARD5, "side.bias", "coverage"),
    }
    assert "[14]" in fails(report, tensor="side.bias")[0]["detail"]


# --------------------------------------------------------------------------- 12. unreadable


def _assert_exit_2_one_line(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("zerosafe: error: ")
    for n in needles:
        assert n in lines[0]


def test_empty_folder_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match="nothing to verify"):
        verify_output(str(tmp_path))
    _assert_exit_2_one_line(zerosafe_cli("verify", tmp_path), "nothing to verify")


def test_garbage_index_is_unreadable(out: Path) -> None:
    (out / INDEX).write_text('{"weight_map": {"a": ')
    with pytest.raises(CheckpointFormatError, match="not valid JSON"):
        verify_output(str(out))
    _assert_exit_2_one_line(zerosafe_cli("verify", out), INDEX, "not valid JSON")


@pytest.mark.parametrize(
    "text",
    ["[]", '{"weight_map": {"a": null, "b": "model-00001-of-00005.safetensors"}}'],
    ids=["list", "null-file"],
)
def test_index_of_the_wrong_shape_is_unreadable(out: Path, text: str) -> None:
    (out / INDEX).write_text(text)
    _assert_exit_2_one_line(zerosafe_cli("verify", out), INDEX)


def test_garbage_completion_marker_is_named(out: Path) -> None:
    (out / MARKER).write_text("{garbage")
    r = zerosafe_cli("verify", out)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode in (1, 2)
    assert MARKER in r.stdout + r.stderr


def test_index_without_weight_map_is_unreadable(out: Path) -> None:
    dump_json(out / INDEX, {"metadata": {}, "weight_map": {}})
    with pytest.raises(CheckpointFormatError, match="non-empty 'weight_map'"):
        verify_output(str(out))


# --------------------------------------------------------------------------- 13. other writers


def test_output_without_manifest_written_by_another_tool_passes(out: Path, tmp_path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("model-*.safetensors")):
        tensors.update(load_shard(shard)[0])
    tensors["lm_head.weight"] = tensors["embed.weight"].clone()  # tied weights written as a copy
    other = tmp_path / "other"
    other.mkdir()
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})

    report = verify_output(str(other), against=str(CKPT))
    assert report["ok"], report["failures"]
    assert not report["has_manifest"] and report["complete"] is None
    assert report["num_tensors"] == 21
    r = zerosafe_cli("verify", other)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no manifest" in r.stdout


def test_sharded_output_without_manifest_written_by_another_tool_passes(out: Path) -> None:
    drop_manifest(out)
    for shard in out.glob("model-*.safetensors"):
        tensors, _ = load_shard(shard)
        save_file(tensors, str(shard))  # no metadata at all
    index = load_json(out / INDEX)
    del index["metadata"]["aliases"]
    dump_json(out / INDEX, index)
    report = verify_output(str(out))
    assert report["ok"], report["failures"]
    assert report["aliases"] == {}


@pytest.mark.parametrize("name", [INDEX, MARKER, MANIFEST])
def test_a_fifo_among_the_small_files_is_refused_not_waited_on(out: Path, name: str) -> None:
    """Issue 37 item 8: a FIFO named like the index, marker or manifest hung `verify`. The
    marker's refusal is a failed `complete` check (exit 1), as any unreadable marker is."""
    (out / name).unlink()
    os.mkfifo(out / name)
    r = zerosafe_cli("verify", out)
    needles = (f"{out}/{name}: expected ", "a regular file of at most", "found a FIFO")
    if name == MARKER:
        assert r.returncode == 1 and all(n in r.stdout for n in needles), (r.stdout, r.stderr)
    else:
        _assert_exit_2_one_line(r, *needles)
