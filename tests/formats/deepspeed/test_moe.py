"""zerosafe against real DeepSpeed mixture-of-experts checkpoints (issue 14, item 5).

`tests/deepspeed_gen/train_moe.py` trains native DeepSpeed-MoE (`deepspeed.moe.layer.MoE`,
ZeRO-1/2) and AutoEP (a tiny transformers Mixtral, ZeRO-1/2 and ZeRO-3 "partition-native") on
CPU ranks, with expert-parallel sizes 1, 2 and 4, and saves the fp32 masters of every expert at
save time under the names a model with expert-parallel size 1 holds them by. The output must
equal them byte for byte. DeepSpeed's own `zero_to_fp32` fails on every one of them.

The checkpoints are trained once per session, lazily; ZEROSAFE_DS_CACHE keeps them between runs
(keyed by the spec and `train_moe.py`).
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
from safetensors.torch import load_file

from tests.helpers import load_output, same_bytes
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import CheckpointFormatError, LayoutMismatchError, UnsupportedCheckpointError
from zerosafe.stages.results import RunSummary
from zerosafe.verify.output import verify_output

try:
    from tests.deepspeed_gen import (
        MOE_SCRIPT,
        MOE_SPECS,
        deepspeed_fp32_state_dict,
        spec_key,
        train_checkpoint,
    )
except ImportError:  # tests/ not importable as a package: load it from its folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from deepspeed_gen import (  # type: ignore[no-redef]
        MOE_SCRIPT,
        MOE_SPECS,
        deepspeed_fp32_state_dict,
        spec_key,
        train_checkpoint,
    )

pytestmark = pytest.mark.slow

NAMES = sorted(MOE_SPECS)
NATIVE = [n for n in NAMES if not MOE_SPECS[n].get("autoep")]
AUTOEP = [n for n in NAMES if MOE_SPECS[n].get("autoep")]
FROZEN = [n for n in NAMES if MOE_SPECS[n].get("frozen_expert")]
TAG = "global_step2"
INFIX = ".deepspeed_moe.experts.deepspeed_experts."
# AutoEP registers its router again under the Mixtral block's name (`mlp.gate`).
AUTOEP_ALIASES = {
    f"model.layers.{i}.mlp.gate.gate.weight": f"model.layers.{i}.mlp.router.gate.weight"
    for i in range(2)
}


@dataclass
class Generated:
    name: str
    spec: dict[str, Any]
    ckpt: Path
    live: Path
    ds: dict[str, Any]

    def live_tensors(self) -> dict[str, torch.Tensor]:
        return load_file(self.live)


def _generate(spec: dict[str, Any], root: Path) -> None:
    started = time.monotonic()
    ckpt = train_checkpoint(spec, root, script=MOE_SCRIPT)
    deepspeed_fp32_state_dict(ckpt, root / "deepspeed.safetensors")
    (root / "done.json").write_text(
        json.dumps({"spec": spec, "seconds": round(time.monotonic() - started, 1)})
    )


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Generated]:
    """name -> Generated; trains each checkpoint and runs DeepSpeed's converter at most once."""
    cache_env = os.environ.get("ZEROSAFE_DS_CACHE")
    cache = Path(cache_env).expanduser() if cache_env else None
    made: dict[str, Generated] = {}

    def get(name: str) -> Generated:
        if name in made:
            return made[name]
        spec = MOE_SPECS[name]
        if cache is None:
            root = tmp_path_factory.mktemp(f"moe-{name}")
            _generate(spec, root)
        else:
            root = cache / f"{name}-{spec_key(spec, MOE_SCRIPT)}"
            if not (root / "done.json").is_file():
                scratch = cache / f".{root.name}.{os.getpid()}.tmp"
                shutil.rmtree(scratch, ignore_errors=True)
                _generate(spec, scratch)
                shutil.rmtree(root, ignore_errors=True)
                scratch.rename(root)
        info = json.loads((root / "deepspeed.json").read_text())
        made[name] = Generated(name, spec, root / "ckpt", root / "live.safetensors", info)
        return made[name]

    return get


@dataclass
class Output:
    dir: Path
    summary: RunSummary
    tensors: dict[str, torch.Tensor]
    manifest: dict[str, Any]


@pytest.fixture(scope="session")
def moe_convert(
    moe_checkpoints: Callable[[str], Generated], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Output]:
    done: dict[tuple[Any, ...], Output] = {}

    def run(name: str, **options: Any) -> Output:
        key = (name, *sorted(options.items()))
        if key not in done:
            out = tmp_path_factory.mktemp(f"moe-out-{name}")
            out.rmdir()
            summary = convert_checkpoint(
                str(moe_checkpoints(name).ckpt), str(out), ConvertOptions(**options)
            )
            assert summary.status == "converted", summary
            tensors, manifest = load_output(out)
            done[key] = Output(out, summary, tensors, manifest)
        return done[key]

    return run


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _refused(ckpt: Path, tmp_path: Path) -> Exception:
    with pytest.raises(
        (CheckpointFormatError, LayoutMismatchError, UnsupportedCheckpointError)
    ) as e:
        convert_checkpoint(str(ckpt), str(tmp_path / "out"), ConvertOptions())
    assert not list((tmp_path / "out").glob("*.safetensors")), "wrote weights"
    return e.value


def _inspect(ckpt: Path) -> dict[str, Any]:
    from zerosafe.io.storage import Storage
    from zerosafe.plan.build import plan_checkpoint
    from zerosafe.plan.describe import describe_plan, render_inspect

    options = ConvertOptions(dtype="float32")
    layout, plan = plan_checkpoint(Storage(), str(ckpt), tag=None, options=options)
    report = describe_plan(layout, plan, options, metadata_bytes_read=0)
    report["text"] = render_inspect(report)
    return report


# ---------------------------------------------------------------------------------------------
# Conversion


@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("name", NAMES)
def test_experts_equal_live_masters(name: str, mode: str, moe_checkpoints, moe_convert) -> None:
    """Every expert of every expert-parallel rank, under its global name (native) or in its
    logical `[num_experts, ...]` tensor (AutoEP), equals its fp32 master at save time."""
    gen = moe_checkpoints(name)
    options: dict[str, Any] = {"dtype": "float32"}
    if mode == "direct":
        options.update(direct=True, max_shard_size=8_000)
    ours = moe_convert(name, **options)
    live = gen.live_tensors()
    assert set(ours.tensors) == set(live), (
        f"beyond live: {sorted(set(ours.tensors) - set(live))}; "
        f"missing: {sorted(set(live) - set(ours.tensors))}"
    )
    for key, want in live.items():
        got = ours.tensors[key]
        if want.dtype != torch.float32:  # frozen params and integer buffers keep their dtype
            got = got.to(want.dtype)
        assert same_bytes(got, want), f"{key}: differs from the live master"
    aliases = ours.manifest.get("aliases") or {}
    assert aliases == (AUTOEP_ALIASES if gen.spec.get("autoep") else {})
    experts = [k for k in live if INFIX in k or ".experts.w" in k]
    num_layers = len(gen.spec.get("ep_sizes", [1, 1]))
    if gen.spec.get("autoep"):
        assert len(experts) == 3 * num_layers
        assert all(live[k].shape[0] == gen.spec["num_experts"] for k in experts)
    else:
        ids = {k.split(INFIX)[1].split(".")[0] for k in experts}
        assert ids == {str(i) for i in range(gen.spec["num_experts"])}


@pytest.mark.parametrize("name", NAMES)
def test_deepspeed_converter_fails(name: str, moe_checkpoints) -> None:
    """DeepSpeed's zero_to_fp32 converts none of them: it takes the expert files for model
    states, and refuses AutoEP's partition-native ZeRO-3 outright."""
    gen = moe_checkpoints(name)
    if gen.spec["stage"] == 3:
        assert "partition-native" in gen.ds["error"], gen.ds
    else:
        assert "is not a model state checkpoint" in gen.ds["error"], gen.ds


@pytest.mark.parametrize("name", ["moe-z2-bf16-ws2-ep2-and-ep1", "autoep-z2-bf16-ws2-ep2"])
def test_deepspeed_converter_fails_without_expert_files(
    name: str, moe_checkpoints, tmp_path
) -> None:
    """Without the expert files in its way, zero_to_fp32 still fails: it concatenates the
    expert groups of every rank as if they were one group partitioned over all ranks."""
    ckpt = _copy(moe_checkpoints(name).ckpt, tmp_path / "ckpt")
    for f in (ckpt / TAG).glob("layer_*_expert_*"):
        f.unlink()
    info = deepspeed_fp32_state_dict(ckpt, tmp_path / "ds.safetensors")
    assert info["error"] and "consumed" in info["error"], info


@pytest.mark.parametrize("name", NAMES)
def test_verify_against_checks_experts(name: str, moe_checkpoints, moe_convert) -> None:
    gen = moe_checkpoints(name)
    ours = moe_convert(name, dtype="float32")
    report = verify_output(str(ours.dir), against=str(gen.ckpt))
    assert report["ok"], report["failures"]
    against = report["against"]
    if gen.spec["stage"] < 3 and gen.spec["precision"] != "fp32":
        # the experts' 16-bit witnesses are their expert files
        experts = [k for k in ours.tensors if INFIX in k or ".experts.w" in k]
        assert against["lowp_checked"] >= len(experts) and not against["lowp_mismatched"]


@pytest.mark.parametrize("name", ["moe-z2-bf16-ws2-ep2-and-ep1", "autoep-z3-bf16-ws2-ep2"])
def test_low_precision_output_is_cast_of_fp32(name: str, moe_convert) -> None:
    fp32, bf16 = moe_convert(name, dtype="float32"), moe_convert(name, dtype="bfloat16")
    assert set(fp32.tensors) == set(bf16.tensors)
    for key, full in fp32.tensors.items():
        want = full.to(torch.bfloat16) if full.is_floating_point() else full
        assert same_bytes(bf16.tensors[key], want), key


def test_autoep_router_alias_copied(moe_convert) -> None:
    copy = moe_convert("autoep-z3-bf16-ws2-ep2", dtype="float32", tied="copy")
    for alias, target in AUTOEP_ALIASES.items():
        assert same_bytes(copy.tensors[alias], copy.tensors[target])


@pytest.mark.parametrize("name", FROZEN)
def test_frozen_experts_from_expert_files(name: str, moe_checkpoints, moe_convert) -> None:
    """Frozen expert params have no master: every expert's are read from its expert file
    (rank 0's `frozen_param_shapes` names only its own, by local id); --exclude-frozen drops
    them."""
    gen = moe_checkpoints(name)
    frozen = {
        f"blocks.0.moe{INFIX}{e}.fc2.{w}"
        for e in range(gen.spec["num_experts"])
        for w in ("weight", "bias")
    }
    full = moe_convert(name, dtype="float32")
    assert frozen <= set(full.tensors)
    assert any(
        "frozen expert param(s) taken from the expert files" in n for n in full.manifest["notes"]
    )
    assert full.manifest["source"]["moe"]["frozen_expert_params"] == len(frozen)
    lean = moe_convert(name, dtype="float32", exclude_frozen=True)
    assert set(lean.tensors) == set(full.tensors) - frozen


# ---------------------------------------------------------------------------------------------
# inspect


@pytest.mark.parametrize("name", NAMES)
def test_inspect_reports_moe(name: str, moe_checkpoints) -> None:
    gen = moe_checkpoints(name)
    report = _inspect(gen.ckpt)
    moe = report["moe"]
    ep_sizes = [gen.spec["ep_size"]] * 2 if gen.spec.get("autoep") else gen.spec["ep_sizes"]
    assert moe["kind"] == ("AutoEP" if gen.spec.get("autoep") else "DeepSpeed-MoE")
    assert [x["ep_size"] for x in moe["layers"]] == ep_sizes
    assert all(x["num_experts"] == gen.spec["num_experts"] for x in moe["layers"])
    assert [x["expert_data_parallel_size"] for x in moe["layers"]] == [
        gen.spec["world_size"] // p for p in ep_sizes
    ]
    assert moe["expert_groups"]
    assert f"MoE ({moe['kind']})" in report["text"] and "expert groups:" in report["text"]
    expert_files = 0 if gen.spec["stage"] == 3 else len(ep_sizes) * gen.spec["num_experts"]
    assert moe["expert_files"] == report["files"]["experts"] == expert_files


def test_inspect_names_the_expert_ranks(moe_checkpoints) -> None:
    """The topology: with `use_data_before_expert_parallelism` the expert-data-parallel groups
    are consecutive ranks."""
    moe = _inspect(moe_checkpoints("moe-z2-fp16-ws4-ep2-databefore-frozen").ckpt)["moe"]
    assert moe["layers"][0]["ranks_by_ep_rank"] == [[0, 1], [2, 3]]
    assert moe["layers"][0]["experts_by_ep_rank"] == [[0, 1], [2, 3]]
    moe = _inspect(moe_checkpoints("moe-z2-bf16-ws4-ep4-and-ep2-groups").ckpt)["moe"]
    assert [x["ranks_by_ep_rank"] for x in moe["layers"]] == [
        [[0], [1], [2], [3]],
        [[0, 2], [1, 3]],
    ]


# ---------------------------------------------------------------------------------------------
# Files that disagree, are missing, or are not what zerosafe reads


def _rewrite(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    sd = torch.load(path, weights_only=False)
    change(sd)
    torch.save(sd, path)


def test_expert_group_order_may_differ_between_ranks(
    moe_checkpoints, moe_convert, tmp_path
) -> None:
    """DeepSpeed orders expert groups of several expert-parallel sizes by iterating a set of
    names, so ranks of one save can disagree on the order: groups are matched by name."""
    name = "moe-z2-bf16-ws2-ep2-and-ep1"
    ckpt = _copy(moe_checkpoints(name).ckpt, tmp_path / "ckpt")
    optim = ckpt / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"

    def swap_expert_groups(sd: dict[str, Any]) -> None:
        osd = sd["optimizer_state_dict"]
        order = [0, 2, 1]
        for key in ("single_partition_of_fp32_groups", "partition_count", "group_paddings",
                    "param_alignment_paddings", "param_slice_mappings"):  # fmt: skip
            osd[key] = [osd[key][i] for i in order]
        base = osd["base_optimizer_state"]
        base["param_groups"] = [base["param_groups"][i] for i in order]

    _rewrite(optim, swap_expert_groups)
    summary = convert_checkpoint(str(ckpt), str(tmp_path / "out"), ConvertOptions())
    assert summary.status == "converted"
    got, _ = load_output(tmp_path / "out")
    want = moe_convert(name, dtype="float32").tensors
    assert set(got) == set(want) and all(same_bytes(got[k], want[k]) for k in want)


def test_expert_file_of_another_expert_is_refused(moe_checkpoints, tmp_path) -> None:
    """The first expert of every expert-parallel rank is sampled against the masters: expert
    files swapped (or from another save) are refused, naming the file."""
    ckpt = _copy(moe_checkpoints("moe-z1-bf16opt-ws2-ep2").ckpt, tmp_path / "ckpt")
    a = ckpt / TAG / "layer_0_expert_0_mp_rank_00_model_states.pt"
    b = ckpt / TAG / "layer_0_expert_1_mp_rank_00_model_states.pt"
    sa, sb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    torch.save({k.replace(f"{INFIX}0.", f"{INFIX}1."): v for k, v in sa.items()}, b)
    torch.save({k.replace(f"{INFIX}1.", f"{INFIX}0."): v for k, v in sb.items()}, a)
    err = _refused(ckpt, tmp_path)
    assert isinstance(err, LayoutMismatchError)
    assert "layer_0_expert_0_mp_rank_00_model_states.pt: its bfloat16 copy" in str(err)
    assert "use_data_before_expert_parallelism" in str(err)


def test_missing_and_stale_expert_files_are_refused(moe_checkpoints, tmp_path) -> None:
    src = moe_checkpoints("moe-z1-fp32-ws2-ep2-groups-frozen").ckpt
    ckpt = _copy(src, tmp_path / "missing")
    (ckpt / TAG / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    err = _refused(ckpt, tmp_path)
    assert isinstance(err, CheckpointFormatError)
    assert "expert file(s) of MoE layer 0 missing: layer_0_expert_3" in str(err)
    ckpt = _copy(src, tmp_path / "stale")
    shutil.copy(
        ckpt / TAG / "layer_0_expert_3_mp_rank_00_model_states.pt",
        ckpt / TAG / "layer_0_expert_7_mp_rank_00_model_states.pt",
    )
    err = _refused(ckpt, tmp_path)
    assert isinstance(err, LayoutMismatchError) and "stale expert file layer_0_expert_7" in str(err)


def test_wrong_partition_count_is_refused(moe_checkpoints, tmp_path) -> None:
    ckpt = _copy(moe_checkpoints("moe-z2-bf16-ws4-ep4-and-ep2-groups").ckpt, tmp_path / "ckpt")
    optim = ckpt / TAG / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"

    def count(sd: dict[str, Any]) -> None:
        osd = sd["optimizer_state_dict"]
        names = [g["name"] for g in osd["base_optimizer_state"]["param_groups"]]
        osd["partition_count"][names.index("ep_size_2")] = 4

    _rewrite(optim, count)
    err = _refused(ckpt, tmp_path)
    assert "param group 'ep_size_2' is partitioned over 4 ranks, expected 2" in str(err)


# AutoEP ZeRO-3 "partition-native": the keys zerosafe reads, refused by name when they are not
# what DeepSpeed 0.19.8 writes.
Z3 = "autoep-z3-bf16-ws2-ep2"


def _model_files(ckpt: Path) -> list[Path]:
    return sorted((ckpt / TAG).glob("zero_pp_rank_*_model_states.pt"))


def _optim_files(ckpt: Path) -> list[Path]:
    return sorted((ckpt / TAG).glob("*zero_pp_rank_*_optim_states.pt"))


def test_partition_native_format_version_is_checked(moe_checkpoints, tmp_path) -> None:
    ckpt = _copy(moe_checkpoints(Z3).ckpt, tmp_path / "ckpt")
    for f in _model_files(ckpt):
        _rewrite(
            f, lambda sd: [x.update(checkpoint_format_version=2) for x in sd["ds_autoep_layers"]]
        )
    err = _refused(ckpt, tmp_path)
    assert isinstance(err, UnsupportedCheckpointError)
    assert "`checkpoint_format` 'zero3_partitioned' version 2" in str(err)


def test_partition_native_without_partition_groups_is_refused(moe_checkpoints, tmp_path) -> None:
    ckpt = _copy(moe_checkpoints(Z3).ckpt, tmp_path / "ckpt")
    for f in _optim_files(ckpt):
        _rewrite(f, lambda sd: sd["optimizer_state_dict"].pop("ds_zero_partition_groups"))
    err = _refused(ckpt, tmp_path)
    assert isinstance(err, CheckpointFormatError) and "`ds_zero_partition_groups`" in str(err)


def test_partition_groups_that_disagree_are_refused(moe_checkpoints, tmp_path) -> None:
    ckpt = _copy(moe_checkpoints(Z3).ckpt, tmp_path / "ckpt")

    def claim_both(sd: dict[str, Any]) -> None:
        entry = sd["optimizer_state_dict"]["ds_zero_partition_groups"][1]
        entry.update(partition_ranks=[0, 1], partition_count=2)

    _rewrite(_optim_files(ckpt)[0], claim_both)
    err = _refused(ckpt, tmp_path)
    assert isinstance(err, LayoutMismatchError)
    assert "`ds_zero_partition_groups` sub-group 1 is held by ranks [0, 1]" in str(err)


def test_zero3_moe_without_autoep_layers_is_refused(moe_checkpoints, tmp_path) -> None:
    """`ds_zero_partition_groups` with no `ds_autoep_layers`: not a layout DeepSpeed writes."""
    ckpt = _copy(moe_checkpoints(Z3).ckpt, tmp_path / "ckpt")
    for f in _model_files(ckpt):
        _rewrite(f, lambda sd: sd.update(ds_autoep_layers=None))
    err = _refused(ckpt, tmp_path)
    assert isinstance(err, UnsupportedCheckpointError) and "`ds_autoep_layers`" in str(err)


def test_deepspeed_refuses_native_moe_at_zero3(tmp_path) -> None:
    """Why the native specs stop at ZeRO-2: DeepSpeed 0.19.8 will not train native MoE at
    ZeRO-3 (`_validate_zero3_moe_compatibility`)."""
    spec = {"world_size": 2, "stage": 3, "precision": "fp32", "ep_sizes": [2], "num_experts": 2}
    with pytest.raises(
        RuntimeError, match="Native DeepSpeed MoE is not supported with ZeRO Stage 3"
    ):
        train_checkpoint(spec, tmp_path, attempts=1, script=MOE_SCRIPT)


# MoE combined with pipeline or tensor parallelism: refused, naming the files.


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ("layer_file", "pipeline-parallel layer files (layer_00-model_states.pt)"),
        ("mp_rank_01", "model-parallel rank files (mp_rank_01)"),
    ],
)
def test_experts_beside_model_parallel_files_are_refused(
    moe_checkpoints, tmp_path, change: str, what: str
) -> None:
    """A real ZeRO-1 MoE checkpoint (pipeline stages are ZeRO-1) with a pipeline layer file
    added, or rank 1's optimizer file named as model-parallel rank 1: refused from the listing,
    naming an expert file and the other file."""
    ckpt = _copy(moe_checkpoints("moe-z1-bf16opt-ws2-ep2").ckpt, tmp_path / "ckpt")
    tag = ckpt / TAG
    if change == "layer_file":
        shutil.copy(
            tag / "layer_0_expert_0_mp_rank_00_model_states.pt", tag / "layer_00-model_states.pt"
        )
    else:
        (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").rename(
            tag / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"
        )
    err = _refused(ckpt, tmp_path)
    assert isinstance(err, UnsupportedCheckpointError)
    text = str(err)
    assert "MoE combined with pipeline or tensor parallelism is not supported" in text
    assert "layer_0_expert_0_mp_rank_00_model_states.pt" in text and what in text


def test_autoep_zero3_in_model_parallel_files_is_refused(moe_checkpoints, tmp_path) -> None:
    """AutoEP ZeRO-3 writes no expert files, so the listing does not show MoE: rank 1's files
    named as model-parallel rank 1 (the sequence-parallel naming zerosafe otherwise converts)
    are refused once the MoE layout is read."""
    ckpt = _copy(moe_checkpoints(Z3).ckpt, tmp_path / "ckpt")
    for f in sorted((ckpt / TAG).glob("*zero_pp_rank_1_mp_rank_00_*.pt")):
        f.rename(f.with_name(f.name.replace("_mp_rank_00_", "_mp_rank_01_")))
    err = _refused(ckpt, tmp_path)
    assert isinstance(err, UnsupportedCheckpointError)
    assert "MoE combined with pipeline or tensor parallelism is not supported" in str(err)
    assert "zero_pp_rank_1_mp_rank_01_" in str(err)
