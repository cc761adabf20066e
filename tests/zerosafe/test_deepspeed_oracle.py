"""zerosafe against real DeepSpeed: checkpoints trained with DeepSpeed ZeRO on CPU ranks, checked
against DeepSpeed's own converter (`get_fp32_state_dict_from_zero_checkpoint`) and against the
live training weights (where DeepSpeed's converter drops frozen params or refuses a checkpoint).

The checkpoints are trained once per session, lazily (so `-k` trains only what it selects).
Set ZEROSAFE_DS_CACHE=/some/dir to keep them (and DeepSpeed's answers) between local runs;
entries are keyed by a hash of the spec and of `train_zero.py`.

Every comparison is of bytes (uint8 views), so NaN payloads and -0.0 cannot hide.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zerosafe.config import ConvertOptions
from zerosafe.pipeline import convert_checkpoint
from zerosafe.verify.output import verify_output

try:
    from tests.deepspeed_gen import SPECS, deepspeed_fp32_state_dict, spec_key, train_checkpoint
except ImportError:  # tests/ not importable as a package: load it from its folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from deepspeed_gen import SPECS, deepspeed_fp32_state_dict, spec_key, train_checkpoint

pytestmark = pytest.mark.slow

NAMES = sorted(SPECS)
# TinyLM in train_zero.py: with `frozen`, a side path whose params never train; with `tied`,
# lm_head.weight is embed.weight (DeepSpeed records lm_head.weight as the alias).
FROZEN_PARAMS = {"side.weight", "side.bias", "side_out.weight"}
TIED_ALIASES = {"lm_head.weight": "embed.weight"}
MANIFEST = "zerosafe-manifest.json"
SMALL_SHARDS = 12_000  # bytes: several shards per output (the largest tensor is ~15 KB)


def deepspeed_refusal(spec: dict[str, Any]) -> str | None:
    """What zero_to_fp32 says when it cannot convert a checkpoint DeepSpeed itself wrote:
    bf16 + ZeRO-1 + fp32 grad accumulation is BF16_Optimizer, which it does not know; legacy
    (non-zip) files it loads with mmap, which torch refuses for them."""
    if (
        spec["stage"] == 1
        and spec["precision"] == "bf16"
        and spec.get("grad_accum_dtype") == "fp32"
    ):
        return "not a zero checkpoint"
    if spec.get("legacy_files"):
        return "mmap can only be used with files saved with"
    return None


def refused_by_deepspeed(spec: dict[str, Any]) -> bool:
    return deepspeed_refusal(spec) is not None


def frozen_dropped_by_deepspeed(spec: dict[str, Any]) -> bool:
    """ZeRO-1 saves no frozen_param_fragments; zero_to_fp32 silently leaves frozen params out."""
    return spec["stage"] == 1 and bool(spec.get("frozen")) and not refused_by_deepspeed(spec)


# ---------------------------------------------------------------------------------------------
# Generation (once per session, or reused from ZEROSAFE_DS_CACHE)


@dataclass
class Generated:
    name: str
    spec: dict[str, Any]
    ckpt: Path
    live: Path
    ds: dict[str, Any]  # deepspeed_fp32_state_dict's answer

    def ds_tensors(self) -> dict[str, torch.Tensor]:
        return load_file(self.ds["file"]) if self.ds["file"] else {}

    def live_tensors(self) -> dict[str, torch.Tensor]:
        return load_file(self.live)


def _generate(spec: dict[str, Any], root: Path) -> float:
    started = time.monotonic()
    ckpt = train_checkpoint(spec, root)
    deepspeed_fp32_state_dict(ckpt, root / "deepspeed.safetensors")
    seconds = time.monotonic() - started
    (root / "done.json").write_text(json.dumps({"spec": spec, "seconds": round(seconds, 1)}))
    return seconds


def _load_generated(name: str, root: Path) -> Generated:
    info = json.loads((root / "deepspeed.json").read_text())
    info["file"] = None if info["error"] else str(root / "deepspeed.safetensors")
    return Generated(name, SPECS[name], root / "ckpt", root / "live.safetensors", info)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Generated]:
    """name -> Generated; trains each checkpoint and runs DeepSpeed's converter at most once."""
    cache_env = os.environ.get("ZEROSAFE_DS_CACHE")
    cache = Path(cache_env).expanduser() if cache_env else None
    made: dict[str, Generated] = {}

    def get(name: str) -> Generated:
        if name in made:
            return made[name]
        spec = SPECS[name]
        if cache is None:
            root = tmp_path_factory.mktemp(f"ds-{name}")
            seconds = _generate(spec, root)
            print(f"\n[deepspeed_gen] {name}: trained and converted by DeepSpeed in {seconds:.1f}s")
        else:
            root = cache / f"{name}-{spec_key(spec)}"
            if not (root / "done.json").is_file():
                scratch = cache / f".{root.name}.{os.getpid()}.tmp"
                shutil.rmtree(scratch, ignore_errors=True)
                seconds = _generate(spec, scratch)
                shutil.rmtree(root, ignore_errors=True)
                scratch.rename(root)
                print(f"\n[deepspeed_gen] {name}: trained into cache {root} in {seconds:.1f}s")
        made[name] = _load_generated(name, root)
        return made[name]

    return get


# ---------------------------------------------------------------------------------------------
# Conversions (memoized per session)


@dataclass
class Output:
    dir: Path
    summary: dict[str, Any]
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self.manifest.get("aliases") or {})


def _read_output(out: Path, summary: dict[str, Any]) -> dict[str, torch.Tensor]:
    files = summary["files"]
    if (out / "model.safetensors.index.json").is_file():
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == sorted(files)
    else:
        assert files == ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(out / f), "pt") as handle:
            for key in handle.keys():
                assert key not in tensors, f"{key} stored twice (again in {f})"
                tensors[key] = handle.get_tensor(key)
    return tensors


@pytest.fixture(scope="session")
def convert(
    checkpoints: Callable[[str], Generated], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Output]:
    """convert(name, **ConvertOptions fields) -> Output, converted once per distinct call."""
    done: dict[tuple[Any, ...], Output] = {}

    def run(name: str, **options: Any) -> Output:
        key = (name, *sorted(options.items()))
        if key not in done:
            gen = checkpoints(name)
            tag = "-".join(f"{k}={v}" for k, v in sorted(options.items())) or "default"
            out = tmp_path_factory.mktemp(f"out-{name}-{tag}")
            out.rmdir()
            summary = convert_checkpoint(str(gen.ckpt), str(out), ConvertOptions(**options))
            assert summary["status"] == "converted", summary
            manifest = json.loads((out / MANIFEST).read_text())
            done[key] = Output(out, summary, manifest, _read_output(out, summary))
        return done[key]

    return run


FP32_MODES = {
    "staged": {"dtype": "float32"},
    "direct": {"dtype": "float32", "direct": True, "max_shard_size": SMALL_SHARDS},
}


# ---------------------------------------------------------------------------------------------
# Byte comparison


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape and bytes; on failure say where the first difference is."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    )
    if torch.equal(_bytes(got), _bytes(want)):
        return
    g, w = got.reshape(-1), want.reshape(-1)
    diff = (
        _bytes(got).view(-1, got.element_size()) != _bytes(want).view(-1, want.element_size())
    ).any(dim=1)
    idx = diff.nonzero().reshape(-1)
    first = int(idx[0])
    raise AssertionError(
        f"{what}: {idx.numel()} of {g.numel()} elements differ in bytes; first at flat index "
        f"{first}: got {g[first].item()!r}, expected {w[first].item()!r}"
    )


def upcast(t: torch.Tensor) -> torch.Tensor:
    """What zerosafe's fp32 output holds for a source tensor: floats exactly upcast, ints as is."""
    return t.to(torch.float32) if t.is_floating_point() else t


def expected_extras(gen: Generated, ours: Output) -> set[str]:
    if refused_by_deepspeed(gen.spec):
        return set(ours.tensors)
    if frozen_dropped_by_deepspeed(gen.spec):
        return set(FROZEN_PARAMS)
    return set()


def assert_verified(out: Output, gen: Generated) -> None:
    report = verify_output(str(out.dir), against=str(gen.ckpt))
    if not report["ok"]:
        for failure in report["failures"]:
            print("verify failure:", failure)
    assert report["ok"], f"verify_output failed for {out.dir}: {report['failures']}"


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("mode", sorted(FP32_MODES))
@pytest.mark.parametrize("name", NAMES)
def test_fp32_matches_deepspeed(name: str, mode: str, checkpoints, convert) -> None:
    gen = checkpoints(name)
    ours = convert(name, **FP32_MODES[mode])
    refusal = deepspeed_refusal(gen.spec)
    if refusal is not None:
        assert gen.ds["error"] and refusal in gen.ds["error"], gen.ds
    else:
        assert gen.ds["error"] is None, gen.ds.get("traceback")

    ds = gen.ds_tensors()
    ds_aliases: dict[str, str] = gen.ds["aliases"]
    assert set(ds) | set(ds_aliases) == set(gen.ds["names"])
    for alias, target in ds_aliases.items():
        assert ours.aliases.get(alias) == target, (
            f"DeepSpeed ties {alias} -> {target}; manifest aliases {ours.aliases}"
        )
        assert alias not in ours.tensors, f"{alias} is an alias but also stored (tied='dedupe')"
        assert target in ours.tensors, f"alias target {target} missing"
    for key, want in ds.items():
        assert key in ours.tensors, (
            f"{key} (from DeepSpeed, {want.dtype} {tuple(want.shape)}) missing from our output"
        )
        assert_same(key, ours.tensors[key], upcast(want))

    extras = set(ours.tensors) - set(ds)
    print(
        f"\n{name} [{mode}]: {len(ds)} tensors equal DeepSpeed's; beyond DeepSpeed: {sorted(extras)}"
    )
    assert extras == expected_extras(gen, ours)
    assert ours.aliases == (TIED_ALIASES if gen.spec.get("tied") else {})


@pytest.mark.parametrize("name", NAMES)
def test_fp32_matches_live_weights(name: str, checkpoints, convert) -> None:
    """Every live param/buffer equals our fp32 output cast to its dtype (covers what DeepSpeed can't)."""
    gen = checkpoints(name)
    ours = convert(name, **FP32_MODES["staged"])
    live = gen.live_tensors()
    assert set(ours.tensors) == set(live), (
        f"ours has {sorted(set(ours.tensors) - set(live))} beyond the live model; "
        f"lacks {sorted(set(live) - set(ours.tensors))}"
    )
    for key, want in live.items():
        got = ours.tensors[key]
        assert got.dtype == (torch.float32 if want.is_floating_point() else want.dtype), key
        assert_same(key, got.to(want.dtype), want)
    for alias, target in ours.aliases.items():
        assert alias not in live and target in live


@pytest.mark.parametrize("name", NAMES)
def test_direct_equals_staged(name: str, convert) -> None:
    staged, direct = convert(name, **FP32_MODES["staged"]), convert(name, **FP32_MODES["direct"])
    assert len(direct.summary["files"]) > 1, (
        f"expected several shards with max_shard_size={SMALL_SHARDS}"
    )
    assert set(direct.tensors) == set(staged.tensors)
    assert direct.aliases == staged.aliases
    for key, want in staged.tensors.items():
        assert_same(key, direct.tensors[key], want)


LOWP = [
    "z2-fp16-ws3-rr-frozen-groups",
    "z3-bf16-ws4-frozen-groups-subgroups",
    "z3-fp32-ws3-subgroups-tied-frozen",
    "z1-bf16opt-ws2-tied-frozen",
]


LOWP_MODES: dict[str, dict[str, Any]] = {
    f"{short}-{mode}": {"dtype": dtype, "direct": mode == "direct", "max_shard_size": SMALL_SHARDS}
    for short, dtype in (("bf16", "bfloat16"), ("fp16", "float16"))
    for mode in ("staged", "direct")
}


@pytest.mark.parametrize("lowp", sorted(LOWP_MODES))
@pytest.mark.parametrize("name", LOWP)
def test_low_precision_is_rne_cast_of_fp32(name: str, lowp: str, convert) -> None:
    """bf16/fp16 output == round-to-nearest-even cast (torch `.to`) of our fp32 output, bit for bit."""
    fp32 = convert(name, **FP32_MODES["staged"])
    low = convert(name, **LOWP_MODES[lowp])
    target = getattr(torch, LOWP_MODES[lowp]["dtype"])
    assert set(low.tensors) == set(fp32.tensors)
    assert low.aliases == fp32.aliases
    for key, full in fp32.tensors.items():
        want = full.to(target) if full.is_floating_point() else full
        assert_same(key, low.tensors[key], want)


TIED = [n for n in NAMES if SPECS[n].get("tied")]
FROZEN = [n for n in NAMES if SPECS[n].get("frozen")]


@pytest.mark.parametrize("name", TIED)
def test_tied_copy_stores_alias(name: str, checkpoints, convert) -> None:
    dedupe = convert(name, **FP32_MODES["staged"])
    copy = convert(name, dtype="float32", tied="copy")
    assert set(copy.tensors) == set(dedupe.tensors) | set(TIED_ALIASES)
    for alias, target in TIED_ALIASES.items():
        assert_same(f"{alias} (copy of {target})", copy.tensors[alias], copy.tensors[target])
    for key, want in dedupe.tensors.items():
        assert_same(key, copy.tensors[key], want)


@pytest.mark.parametrize("name", FROZEN)
def test_exclude_frozen_leaves_frozen_out(name: str, checkpoints, convert) -> None:
    full = convert(name, **FP32_MODES["staged"])
    assert FROZEN_PARAMS <= set(full.tensors)
    lean = convert(name, dtype="float32", exclude_frozen=True)
    assert set(lean.tensors) == set(full.tensors) - FROZEN_PARAMS
    for key, want in lean.tensors.items():
        assert_same(key, want, full.tensors[key])


VARIANTS: dict[str, dict[str, Any]] = {
    **FP32_MODES,
    **LOWP_MODES,
    "tied-copy": {"dtype": "float32", "tied": "copy"},
    "exclude-frozen": {"dtype": "float32", "exclude_frozen": True},
}
VERIFY_CASES = [
    pytest.param(
        name,
        variant,
        id=f"{name}-{variant}",
    )
    for name in NAMES
    for variant in VARIANTS
    if (variant != "tied-copy" or SPECS[name].get("tied"))
    and (variant != "exclude-frozen" or SPECS[name].get("frozen"))
    and (variant not in LOWP_MODES or name in LOWP)
]


@pytest.mark.parametrize(("name", "variant"), VERIFY_CASES)
def test_verify_output_passes(name: str, variant: str, checkpoints, convert) -> None:
    """verify_output(out, against=ckpt) accepts every output we made (all policies)."""
    assert_verified(convert(name, **VARIANTS[variant]), checkpoints(name))
