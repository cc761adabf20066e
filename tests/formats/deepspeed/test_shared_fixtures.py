"""Every checkpoint of ../shared/fixtures/deepspeed (real DeepSpeed 0.19.8 output) against
DeepSpeed's own golden consolidation, and against the live training weights where DeepSpeed
drops (ZeRO-1 frozen params) or refuses (BF16_Optimizer) weights.

Skipped when ../shared is absent: tests/formats/deepspeed/test_oracle.py generates fresh
checkpoints with DeepSpeed instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import SHARED_FIXTURES, shared_fixture_names
from tests.helpers import load_output, same_bytes, upcast
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint

NAMES = shared_fixture_names()
pytestmark = pytest.mark.skipif(not NAMES, reason=f"{SHARED_FIXTURES} not present")


def _golden(name: str, tag_dir: str = "") -> tuple[dict[str, torch.Tensor] | None, dict[str, str]]:
    gdir = SHARED_FIXTURES / name / "golden" / tag_dir
    path = gdir / "fp32_state_dict.safetensors"
    aliases = (
        json.loads((gdir / "aliases.json").read_text()).get("fp32_state_dict", [])
        if (gdir / "aliases.json").exists()
        else []
    )
    return (load_file(str(path)) if path.exists() else None), dict(map(tuple, aliases))


def _check_against_golden(
    ours: dict, manifest: dict, golden: dict, aliases: dict[str, str]
) -> None:
    for key, want in golden.items():
        if key in aliases:
            assert manifest["aliases"].get(key) == aliases[key], key
            assert aliases[key] in ours and key not in ours
            continue
        assert key in ours, f"{key} missing"
        assert same_bytes(ours[key], upcast(want)), key


@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
@pytest.mark.parametrize("name", NAMES)
def test_fp32_output_is_bit_exact_with_deepspeed(name: str, direct: bool, tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = convert_checkpoint(
        str(SHARED_FIXTURES / name / "checkpoint"),
        str(out),
        ConvertOptions(direct=direct, max_shard_size=30_000),
    )
    ours, manifest = load_output(out)
    golden, aliases = _golden(name)
    manifest_meta = json.loads((SHARED_FIXTURES / name / "manifest.json").read_text())
    if golden is not None:
        _check_against_golden(ours, manifest, golden, aliases)
    else:
        assert manifest_meta["expect_converter_error"], "a golden is missing"
    # Where DeepSpeed drops or refuses weights, the live training weights are the reference.
    live = load_file(str(SHARED_FIXTURES / name / "golden" / "live_params_lowp.safetensors"))
    for key, want in live.items():
        if key in manifest["aliases"]:
            continue
        assert same_bytes(ours[key].to(want.dtype), want), key
    expected = set(live) - set(manifest["aliases"])
    assert set(ours) == expected, set(ours) ^ expected
    assert summary.integrity is not None
    assert summary.integrity.records_failed == () and summary.integrity.records_skipped == ()


@pytest.mark.parametrize("name", [n for n in NAMES if "2tags" in n])
def test_older_tag(name: str, tmp_path: Path) -> None:
    meta = json.loads((SHARED_FIXTURES / name / "manifest.json").read_text())
    older = [t for t in meta["tags"] if t != meta["latest"]][0]
    out = tmp_path / "out"
    convert_checkpoint(str(SHARED_FIXTURES / name / "checkpoint"), str(out), tag=older)
    ours, manifest = load_output(out)
    assert manifest["source"]["tag"] == older
    golden, aliases = _golden(name, f"tag-{older}")
    assert golden is not None
    _check_against_golden(ours, manifest, golden, aliases)


@pytest.mark.parametrize("name", [n for n in NAMES if "frozen" in n and n.startswith(("z2", "z3"))])
def test_exclude_frozen_matches_deepspeed(name: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert_checkpoint(
        str(SHARED_FIXTURES / name / "checkpoint"), str(out), ConvertOptions(exclude_frozen=True)
    )
    ours, manifest = load_output(out)
    excluded = load_file(
        str(SHARED_FIXTURES / name / "golden" / "fp32_state_dict.exclude_frozen.safetensors")
    )
    full, _ = _golden(name)
    assert full is not None
    frozen = set(full) - set(excluded)
    assert frozen and not frozen & set(ours)
    for key in excluded:
        if key not in manifest["aliases"]:
            assert same_bytes(ours[key], upcast(excluded[key])), key


@pytest.mark.parametrize(
    "name", [n for n in NAMES if (SHARED_FIXTURES / n / "golden" / "converter_bf16").exists()]
)
def test_bf16_output_matches_deepspeed_bf16_and_rne_cast(name: str, tmp_path: Path) -> None:
    out32, out16 = tmp_path / "fp32", tmp_path / "bf16"
    convert_checkpoint(
        str(SHARED_FIXTURES / name / "checkpoint"), str(out32), ConvertOptions(direct=True)
    )
    convert_checkpoint(
        str(SHARED_FIXTURES / name / "checkpoint"), str(out16), ConvertOptions(dtype="bf16")
    )
    fp32, _ = load_output(out32)
    bf16, _ = load_output(out16)
    theirs = load_file(
        str(SHARED_FIXTURES / name / "golden" / "converter_bf16" / "model.safetensors")
    )
    for key, t in bf16.items():
        want = fp32[key].to(torch.bfloat16) if fp32[key].is_floating_point() else fp32[key]
        assert same_bytes(t, want), key
        if key in theirs:
            assert same_bytes(t, theirs[key]), key


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in NAMES
        if (SHARED_FIXTURES / n / "golden" / "converter_fp32" / "model.safetensors").exists()
    ],
)
def test_deepspeeds_own_output_passes_verify_against(name: str) -> None:
    """Files written by DeepSpeed's converter (no manifest) pass every check, coverage included.

    Where DeepSpeed drops frozen params (ZeRO-1), coverage names them: that is the check
    doing its job, and the only failure allowed.
    """
    from zerosafe.verify.output import verify_output

    report = verify_output(
        str(SHARED_FIXTURES / name / "golden" / "converter_fp32"),
        against=str(SHARED_FIXTURES / name / "checkpoint"),
    )
    meta = json.loads((SHARED_FIXTURES / name / "manifest.json").read_text())
    dropped = set(meta["model"]["frozen_params"]) if meta["stage"] == 1 else set()
    failures = {(f["tensor"], f["check"]) for f in report["failures"]}
    assert failures == {(t, "coverage") for t in dropped}, report["failures"]
    assert (
        report["against"]["lowp_checked"] > 0 or meta["precision"] == "fp32" or meta["stage"] == 3
    )


def test_check_lowp_passes_on_real_bf16_zero1_and_is_recorded(tmp_path: Path) -> None:
    name = "z1-bf16-ws4-tied-frozen-2groups"
    if name not in NAMES:
        pytest.skip(f"{name} not in the shared fixtures")
    out = tmp_path / "out"
    convert_checkpoint(
        str(SHARED_FIXTURES / name / "checkpoint"), str(out), ConvertOptions(check_lowp=True)
    )
    _, manifest = load_output(out)
    lowp = manifest["checks"]["lowp_cross_check"]
    assert lowp["lowp_checked"] == 13 and lowp["lowp_mismatched"] == 0  # 9 trained + 4 frozen
