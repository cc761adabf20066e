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
from zerosafe.driver import convert_checkpoint
from zerosafe.stages.results import RunSummary
from zerosafe.verify.output import verify_output

try:
    from tests.deepspeed_gen import SPECS, deepspeed_fp32_state_dict, spec_key, train_checkpoint
except ImportError:  # tests/ not importable as a package: load it from its folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from deepspeed_gen import SPECS, deepspeed_fp32_state_dict, spec_key, train_checkpoint

pytestmark = pytest.mark.slow

NAMES = sorted(SPECS)
# TinyLM in train_zero.py: with `frozen`, a side path whose params never train; with `tied`,
# lm_head.weight is embed.weight (DeepSpeed records lm_head.weight as the alias).
FROZEN_PARAMS = {"side.weight", "side.bias", "side_out.weight"}
TIED_ALIASES = {"lm_head.weight": "embed.weight"}
# With `zero_size`: two zero-element params (train_zero.py). ZeRO-1 keeps them out of every
# group and saves no frozen shapes, so DeepSpeed's converter drops them; DeepSpeed ties empty
# tensors to each other (equal data_ptr), so at ZeRO-2 its converter gives `empty.mat` the
# (0,)-shaped tensor of `empty.vec`.
ZERO_SIZE = {"empty.vec": (0,), "empty.mat": (0, 40)}
MASTER_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
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
    summary: RunSummary
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self.manifest.get("aliases") or {})


def _read_output(out: Path, summary: RunSummary) -> dict[str, torch.Tensor]:
    files = summary.files
    if (out / "model.safetensors.index.json").is_file():
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == sorted(files)
    else:
        assert files == ("model.safetensors",)
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
            assert summary.status == "converted", summary
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
    extras = set(FROZEN_PARAMS) if frozen_dropped_by_deepspeed(gen.spec) else set()
    if gen.spec.get("zero_size") and gen.spec["stage"] == 1:
        extras |= set(ZERO_SIZE)  # not in param_shapes, no frozen shapes at ZeRO-1
    return extras


def wrong_ties(gen: Generated) -> dict[str, str]:
    """DeepSpeed's ties between zero-element params, which share nothing."""
    return {a: t for a, t in gen.ds["aliases"].items() if a in ZERO_SIZE}


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
    for alias, target in wrong_ties(gen).items():  # DeepSpeed wrong: zerosafe writes both
        assert tuple(ds[target].shape) != ZERO_SIZE[alias], "DeepSpeed got the shape right now"
        assert tuple(ours.tensors[alias].shape) == ZERO_SIZE[alias]
        ds_aliases = {a: t for a, t in ds_aliases.items() if a != alias}
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

    extras = set(ours.tensors) - set(ds) - set(wrong_ties(gen))
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
    assert len(direct.summary.files) > 1, (
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


LOW_MASTERS = [n for n in NAMES if SPECS[n].get("master")]
ZERO_SIZED = [n for n in NAMES if SPECS[n].get("zero_size")]
MUON = [n for n in NAMES if SPECS[n].get("optimizer") == "muon"]


def _inspect(gen: Generated) -> dict[str, Any]:
    from zerosafe.io.storage import Storage
    from zerosafe.plan.build import plan_checkpoint
    from zerosafe.plan.describe import describe_plan, render_inspect

    options = ConvertOptions(dtype="float32")
    storage = Storage()
    layout, plan = plan_checkpoint(storage, str(gen.ckpt), tag=None, options=options)
    report = describe_plan(layout, plan, options, metadata_bytes_read=storage.counter.bytes_read)
    report["text"] = render_inspect(report)
    return report


def saved_master_bytes(ckpt: Path) -> int:
    """Bytes of the master partitions the optimizer files hold, in their own dtype."""
    tag = (ckpt / "latest").read_text().strip()
    total = 0
    for f in (ckpt / tag).glob("*optim_states.pt"):
        osd = torch.load(f, weights_only=False)["optimizer_state_dict"]
        groups = osd.get("fp32_flat_groups") or osd["single_partition_of_fp32_groups"]
        total += sum(t.numel() * t.element_size() for t in groups)
    return total


@pytest.mark.parametrize("name", LOW_MASTERS)
def test_low_precision_masters(name: str, checkpoints, convert) -> None:
    """bf16/fp16 masters: read in their dtype (DeepSpeed's converter returns them so, beside
    fp32 buffers), stated in the manifest and `inspect`, bytes counted in that dtype."""
    gen = checkpoints(name)
    master = MASTER_DTYPES[gen.spec["master"]]
    master_name = str(master).removeprefix("torch.")
    ours = convert(name, **FP32_MODES["staged"])
    assert ours.manifest["source"]["master_dtype"] == master_name
    ds = gen.ds_tensors()
    trained = [k for k in ds if k not in ZERO_SIZE and not k.startswith("step_")]
    assert trained and all(ds[k].dtype == master for k in trained), "DeepSpeed upcasts now"
    report = _inspect(gen)
    assert report["master_dtype"] == master_name
    assert f"master weights in {master_name}" in report["text"]
    masters = saved_master_bytes(gen.ckpt)  # the real dtype's bytes, padding included
    assert masters < report["params"]["trained_elements"] * 4
    assert report["reads"]["fp32_master_bytes"] == masters
    assert ours.summary.stats.fp32_bytes == masters
    low = convert(name, dtype=master_name)  # the masters' own dtype: their bytes, unchanged
    for key, want in ours.tensors.items():
        if want.is_floating_point() and key in ds and ds[key].dtype == master:
            assert_same(key, low.tensors[key], ds[key])


@pytest.mark.parametrize("name", ZERO_SIZED)
def test_zero_element_params(name: str, checkpoints, convert) -> None:
    gen = checkpoints(name)
    ours = convert(name, **FP32_MODES["staged"])
    lean = convert(name, dtype="float32", exclude_frozen=True)
    for key, shape in ZERO_SIZE.items():
        for out in (ours, lean):
            assert tuple(out.tensors[key].shape) == shape and out.tensors[key].numel() == 0
        assert key not in ours.aliases
    report = _inspect(gen)
    assert sorted(report["zero_element_params"]) == sorted(ZERO_SIZE)
    assert any("zero-element" in n for n in report["notes"])


@pytest.mark.parametrize("name", MUON)
def test_muon_reads_only_masters(name: str, checkpoints, convert) -> None:
    gen = checkpoints(name)
    ours = convert(name, **FP32_MODES["staged"])
    assert ours.manifest["source"]["optimizer_name"].startswith("Muon")
    assert "momentum_buffer" in ours.manifest["source"]["optimizer_name"]
    report = _inspect(gen)
    assert "optimizer Muon" in report["text"] and "momentum_buffer" in report["text"]
    assert ours.summary.stats.fp32_bytes == saved_master_bytes(gen.ckpt)


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


# ---------------------------------------------------------------------------------------------
# NVMe offload (ZeRO-3 `offload_optimizer: {device: nvme}`): DeepSpeed needs libaio (its
# async_io op) to train so, which these machines lack, and swaps only sub-groups of at least
# 1 MiB of masters. The layout is therefore made from a real ZeRO-3 checkpoint the way
# DeepSpeed 0.19.8 writes it (engine.py `save_checkpoint`, swap_tensor/optimizer_utils.py):
# each swapped sub-group's tensor in `fp32_flat_groups` saved empty (`torch.Tensor()`), its
# masters raw in `<tag>/offloaded_tensors/rank<NN>/<first ds_id>_<last ds_id>.tensor.swp`,
# padded to 1024 bytes, moments beside them as `exp_avg-<ids>.tensor.swp`.

NVME_SOURCE = "z3-fp32-ws3-subgroups-tied-frozen"


def make_nvme_checkpoint(
    src: Path, dest: Path, *, groups: set[int] | None = None, id_base: int = 0
) -> list[Path]:
    """Copy `src` with the masters of `groups` (all by default) moved to swap files, ds_ids
    counted from `id_base` in `module.parameters()` order. Returns the master swap files."""
    shutil.copytree(src, dest)
    tag = (dest / "latest").read_text().strip()
    model0 = torch.load(
        dest / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False
    )
    skip = set(model0["buffer_names"]) | set(model0["shared_params"] or {})
    order = [k for k in model0["module"] if k not in skip]
    ds_id = {name: id_base + i for i, name in enumerate(order)}
    written = []
    for optim in sorted((dest / tag).glob("*zero_pp_rank_*_optim_states.pt")):
        rank = int(optim.name.split("zero_pp_rank_")[1].split("_")[0])
        sd = torch.load(optim, weights_only=False)
        flat = sd["optimizer_state_dict"]["fp32_flat_groups"]
        folder = dest / tag / "offloaded_tensors" / f"rank{rank:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for g in sorted(groups if groups is not None else range(len(flat))):
            names = list(model0["param_shapes"][g])
            stem = f"{ds_id[names[0]]}_{ds_id[names[-1]]}"
            raw = flat[g].contiguous().view(torch.uint8).numpy().tobytes()
            raw += b"\0" * (-len(raw) % 1024)
            (folder / f"{stem}.tensor.swp").write_bytes(raw)
            (folder / f"exp_avg-{stem}.tensor.swp").write_bytes(b"\x7f" * len(raw))
            written.append(folder / f"{stem}.tensor.swp")
            flat[g] = torch.Tensor()
        torch.save(sd, optim)
    return written


def _convert_dir(ckpt: Path, out: Path, **options: Any) -> dict[str, torch.Tensor]:
    summary = convert_checkpoint(str(ckpt), str(out), ConvertOptions(**options))
    assert summary.status == "converted", summary
    return _read_output(out, summary)


@pytest.mark.parametrize("mode", sorted(FP32_MODES))
@pytest.mark.parametrize(("groups", "id_base"), [(None, 0), ({0, 2}, 7)], ids=["all", "some"])
def test_nvme_swapped_masters(mode, groups, id_base, checkpoints, convert, tmp_path) -> None:
    gen = checkpoints(NVME_SOURCE)
    ckpt = tmp_path / "nvme"
    make_nvme_checkpoint(gen.ckpt, ckpt, groups=groups, id_base=id_base)
    got = _convert_dir(ckpt, tmp_path / "out", **FP32_MODES[mode])
    want = convert(NVME_SOURCE, **FP32_MODES["staged"]).tensors
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert_same(key, got[key], tensor)
    live = gen.live_tensors()
    for key, tensor in got.items():
        assert_same(key, tensor.to(live[key].dtype), live[key])
    report = _inspect(Generated(NVME_SOURCE, gen.spec, ckpt, gen.live, gen.ds))
    assert report["nvme_swap_files"] > 0 and "NVMe swap files" in report["text"]
    assert report["reads"]["fp32_master_bytes"] == saved_master_bytes(gen.ckpt)
    assert report_ok(verify_output(str(tmp_path / "out"), against=str(ckpt)))


def report_ok(report: dict[str, Any]) -> bool:
    for failure in report["failures"]:
        print("verify failure:", failure)
    return bool(report["ok"])


def test_nvme_deepspeed_converter_fails(checkpoints, tmp_path) -> None:
    """DeepSpeed's zero_to_fp32 reads only the (empty) optimizer-file partitions."""
    ckpt = tmp_path / "nvme"
    make_nvme_checkpoint(checkpoints(NVME_SOURCE).ckpt, ckpt)
    info = deepspeed_fp32_state_dict(ckpt, tmp_path / "ds.safetensors")
    assert info["error"], "DeepSpeed's converter now reads NVMe swap files"


def test_nvme_missing_swap_files_refused(checkpoints, tmp_path) -> None:
    from zerosafe.errors import UnsupportedCheckpointError

    ckpt = tmp_path / "nvme"
    swaps = make_nvme_checkpoint(checkpoints(NVME_SOURCE).ckpt, ckpt)
    swaps[-1].unlink()
    with pytest.raises(UnsupportedCheckpointError) as err:
        convert_checkpoint(str(ckpt), str(tmp_path / "out"), ConvertOptions())
    text = str(err.value)
    assert "offloaded_tensors/rank" in text and "NVMe" in text and "Nothing was written" in text
    assert not list((tmp_path / "out").glob("**/*.safetensors")), "wrote weights"
    shutil.rmtree(ckpt / "global_step2" / "offloaded_tensors")
    with pytest.raises(UnsupportedCheckpointError, match="swap files are missing"):
        convert_checkpoint(str(ckpt), str(tmp_path / "out"), ConvertOptions())


def test_nvme_truncated_swap_file_refused(checkpoints, tmp_path) -> None:
    from zerosafe.errors import LayoutMismatchError

    ckpt = tmp_path / "nvme"
    swaps = make_nvme_checkpoint(checkpoints(NVME_SOURCE).ckpt, ckpt)
    swaps[0].write_bytes(swaps[0].read_bytes()[:100])
    with pytest.raises(LayoutMismatchError, match="tensor.swp: expected"):
        convert_checkpoint(str(ckpt), str(tmp_path / "out"), ConvertOptions())


NVME_SPEC: dict[str, Any] = {
    "world_size": 2, "stage": 3, "precision": "bf16", "offload": "nvme", "cpu_adam": True,
    "steps": 2, "dims": [1100, 512, 64], "layers": 1,
}  # fmt: skip
"""Big enough that each rank's sub-group (597K fp32 masters) passes the 1 MiB swap threshold."""


@pytest.mark.skipif(
    os.environ.get("ZEROSAFE_NVME") != "1",
    reason="real NVMe offload needs libaio (apt install libaio-dev) and about 7 minutes of "
    "training on 2 cores; set ZEROSAFE_NVME=1 to run it",
)
def test_nvme_real_deepspeed(tmp_path) -> None:
    """DeepSpeed trains with `offload_optimizer: {device: nvme}` and saves the masters in
    `offloaded_tensors/`: zerosafe equals the live weights; DeepSpeed's converter fails."""
    ckpt = train_checkpoint(NVME_SPEC, tmp_path / "train", attempts=1, timeout=1500)
    tag = (ckpt / "latest").read_text().strip()
    assert list((ckpt / tag / "offloaded_tensors" / "rank00").glob("*_*.tensor.swp"))
    got = _convert_dir(ckpt, tmp_path / "out", dtype="float32")
    live = load_file(tmp_path / "train" / "live.safetensors")
    assert set(got) == set(live)
    for key, tensor in got.items():
        assert_same(key, tensor.to(live[key].dtype), live[key])
    info = deepspeed_fp32_state_dict(ckpt, tmp_path / "ds.safetensors")
    assert info["error"] and "numels" in info["error"], info["error"]
