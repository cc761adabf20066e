"""Pipeline-parallel DeepSpeed checkpoints (`PipelineModule` + ZeRO-1), trained for real on CPU
ranks by `tests/deepspeed_gen/train_pipe.py`, converted and compared bit for bit with every
stage's live fp32 masters, buffers and frozen params at save time.

DeepSpeed's own converter is no oracle here: `zero_to_fp32` fails on every pipeline checkpoint
(`module` is None in the stages' model states), which `test_deepspeed_converter_fails` pins.

Set ZEROSAFE_DS_CACHE=/some/dir to keep the trained checkpoints between local runs; entries are
keyed by a hash of the spec and of `train_pipe.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import CheckpointFormatError, LayoutMismatchError
from zerosafe.stages.results import RunSummary
from zerosafe.verify.output import verify_output

try:
    from tests.deepspeed_gen import (
        PIPE_SCRIPT,
        PIPE_SPECS,
        deepspeed_fp32_state_dict,
        spec_key,
        train_checkpoint,
    )
except ImportError:  # tests/ not importable as a package: load it from its folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from deepspeed_gen import (
        PIPE_SCRIPT,
        PIPE_SPECS,
        deepspeed_fp32_state_dict,
        spec_key,
        train_checkpoint,
    )

pytestmark = pytest.mark.slow

NAMES = sorted(PIPE_SPECS)
TIED = "tied_modules.embed.weight"
SMALL_SHARDS = 12_000


def _generate(spec: dict[str, Any], root: Path) -> None:
    ckpt = train_checkpoint(spec, root, script=PIPE_SCRIPT)
    deepspeed_fp32_state_dict(ckpt, root / "deepspeed.safetensors")
    (root / "done.json").write_text(json.dumps({"spec": spec}))


@pytest.fixture(scope="session")
def pipe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> the folder holding `ckpt/`, `live.safetensors` and `deepspeed.json`."""
    cache_env = os.environ.get("ZEROSAFE_DS_CACHE")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            spec = PIPE_SPECS[name]
            if cache_env:
                root = Path(cache_env).expanduser() / f"{name}-{spec_key(spec, PIPE_SCRIPT)}"
                if not (root / "done.json").is_file():
                    scratch = root.with_name(f".{root.name}.{os.getpid()}.tmp")
                    shutil.rmtree(scratch, ignore_errors=True)
                    _generate(spec, scratch)
                    shutil.rmtree(root, ignore_errors=True)
                    scratch.rename(root)
            else:
                root = tmp_path_factory.mktemp(f"pipe-{name}")
                _generate(spec, root)
            made[name] = root
        return made[name]

    return get


def _read(out: Path, summary: RunSummary) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in summary.files:
        with safe_open(str(out / f), "pt") as handle:
            for key in handle.keys():
                assert key not in tensors
                tensors[key] = handle.get_tensor(key)
    return tensors


@pytest.fixture(scope="session")
def converted(
    pipe_ckpt: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., tuple[Path, dict[str, Any], dict[str, torch.Tensor]]]:
    done: dict[tuple[Any, ...], tuple[Path, dict[str, Any], dict[str, torch.Tensor]]] = {}

    def run(name: str, **options: Any) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
        key = (name, *sorted(options.items()))
        if key not in done:
            out = tmp_path_factory.mktemp(f"pipe-out-{name}") / "out"
            summary = convert_checkpoint(
                str(pipe_ckpt(name) / "ckpt"), str(out), ConvertOptions(**options)
            )
            assert summary.status == "converted", summary
            done[key] = (out, summary, _read(out, summary))
        return done[key]

    return run


def _same_bytes(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    assert torch.equal(
        got.contiguous().reshape(-1).view(torch.uint8),
        want.contiguous().reshape(-1).view(torch.uint8),
    ), f"{what}: bytes differ"


@pytest.mark.parametrize("name", NAMES)
def test_matches_live_masters(name: str, pipe_ckpt, converted) -> None:
    """Every stage's fp32 masters, buffers and frozen params, under the PipelineModule's names."""
    spec = PIPE_SPECS[name]
    _, _, ours = converted(name, dtype="float32")
    live_file = pipe_ckpt(name) / "live.safetensors"
    live = load_file(live_file)
    assert set(ours) == set(live), (sorted(set(ours) - set(live)), sorted(set(live) - set(ours)))
    for key, want in live.items():
        got = ours[key]
        if want.is_floating_point():
            assert got.dtype == torch.float32, key
            _same_bytes(key, got.to(want.dtype), want)  # masters are fp32: exact
        else:
            _same_bytes(key, got, want)
    with safe_open(str(live_file), "pt") as handle:
        tied_stages = json.loads(handle.metadata()["tied_stages"])
    if spec.get("tied"):  # the tied embedding: trained on the first and the last stage
        ends = [0, spec["pipe"] - 1]
        want = {TIED: ends}
        if spec.get("tied_head") == "module":  # with its buffer, equal on both stages too
            want["tied_modules.embed.temperature"] = ends
        assert tied_stages == want
    else:
        assert tied_stages == {}


def _plan(ckpt: Path, **options: Any) -> tuple[Any, Any, dict[str, Any], str]:
    from zerosafe.io.storage import Storage
    from zerosafe.plan.build import plan_checkpoint
    from zerosafe.plan.describe import describe_plan, render_inspect

    opts = ConvertOptions(**options)
    storage = Storage()
    layout, plan = plan_checkpoint(storage, str(ckpt), tag=None, options=opts)
    report = describe_plan(layout, plan, opts, metadata_bytes_read=storage.counter.bytes_read)
    return layout, plan, report, render_inspect(report)


@pytest.mark.parametrize("name", NAMES)
def test_output_order_is_state_dict_order(name: str, pipe_ckpt) -> None:
    """Tied modules first (PipelineModule registers them before the layers), then the
    layers by index, each in its state_dict order (buffers of a Block before its children)."""
    _, plan, _, _ = _plan(pipe_ckpt(name) / "ckpt")
    names = [t.name for t in plan.tensors]
    layer = [int(n.split(".")[0]) if n[0].isdigit() else -1 for n in names]
    assert layer == sorted(layer), names
    block = [n.split(".", 1)[1] for n in names if n.startswith("2.")]
    assert block[:2] == ["scale", "calls"] and block[2] in ("up.weight", "norm.weight"), block


def test_deepspeed_converter_fails(pipe_ckpt) -> None:
    """zero_to_fp32 reads `module` of every `*_model_states.pt`: None in a pipeline stage's."""
    for name in ("pp2-fp32-tied", "pp2-dp2-bf16-tied"):
        info = json.loads((pipe_ckpt(name) / "deepspeed.json").read_text())
        assert info["error"] and "NoneType" in info["error"], (
            f"DeepSpeed's converter now reads pipeline checkpoints: {info}"
        )


@pytest.mark.parametrize("name", NAMES)
def test_inspect_names_stages(name: str, pipe_ckpt) -> None:
    spec = PIPE_SPECS[name]
    _, _, report, text = _plan(pipe_ckpt(name) / "ckpt", dtype="float32")
    stages = spec["pipe"]
    assert f"pipeline parallel: {stages} stages" in text, text
    pipeline = report["pipeline"]
    assert pipeline["stages"] == stages and len(pipeline["params_by_stage"]) == stages
    for s, params in enumerate(pipeline["params_by_stage"]):
        assert f"    stage {s}: {len(params)} trained params" in text
    assert (TIED in pipeline["tied_across_stages"]) == bool(spec.get("tied"))
    if spec.get("tied"):
        assert pipeline["tied_across_stages"][TIED] == [0, stages - 1]
        assert f"tied across stages: {TIED} on stages 0, {stages - 1}" in text
    assert report["world_size"] == spec["world_size"] // stages
    assert any("pipeline-parallel checkpoint" in n for n in report["notes"])


@pytest.mark.parametrize("name", NAMES)
def test_verify_against_with_lowp(name: str, pipe_ckpt, converted) -> None:
    out, _, _ = converted(name, dtype="float32")
    report = verify_output(str(out), against=str(pipe_ckpt(name) / "ckpt"))
    assert report["ok"], report["failures"]
    against = report["against"]
    assert against["source_identity"] == "same contents" and against["values_sampled"] > 0
    if PIPE_SPECS[name]["precision"] == "bf16":  # every stage's layer files: 16-bit copies
        assert against["lowp_checked"] > 10 and against["lowp_mismatched"] == 0


@pytest.mark.parametrize("name", ["pp2-dp2-bf16-tied", "pp3-bf16-tied-frozen"])
def test_direct_bf16_and_rerun(name: str, pipe_ckpt, converted, tmp_path) -> None:
    staged = converted(name, dtype="float32")[2]
    out, summary, direct = converted(
        name, dtype="bfloat16", direct=True, max_shard_size=SMALL_SHARDS, check_lowp=True
    )
    assert len(summary.files) > 1
    assert set(direct) == set(staged)
    for key, want in staged.items():
        _same_bytes(key, direct[key], want.to(torch.bfloat16) if want.is_floating_point() else want)
    again = convert_checkpoint(
        str(pipe_ckpt(name) / "ckpt"), str(out),
        ConvertOptions(dtype="bfloat16", direct=True, max_shard_size=SMALL_SHARDS, check_lowp=True),
    )  # fmt: skip
    assert again.status == "already-complete"  # quick_identities == the layout's files


def test_exclude_frozen(converted) -> None:
    full = converted("pp3-bf16-tied-frozen", dtype="float32")[2]
    lean = converted("pp3-bf16-tied-frozen", dtype="float32", exclude_frozen=True)[2]
    frozen = {"2.up.weight", "2.up.bias", "3.up.weight", "3.up.bias"}
    assert frozen <= set(full) and set(lean) == set(full) - frozen


# ---------------------------------------------------------------------------------------------
# Refusals


def _copy(pipe_ckpt, name: str, dest: Path) -> Path:
    shutil.copytree(pipe_ckpt(name) / "ckpt", dest)
    return dest / (dest / "latest").read_text().strip()


def test_missing_stage_files_are_named(pipe_ckpt, tmp_path) -> None:
    tag = _copy(pipe_ckpt, "pp2-fp32-tied", tmp_path / "ckpt")
    (tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(CheckpointFormatError, match="pipeline stage 1's files are missing"):
        convert_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    tag = _copy(pipe_ckpt, "pp2-fp32-tied", tmp_path / "ckpt2")
    (tag / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError, match=r"mp_rank_01_model_states\.pt.*2 pipeline"):
        convert_checkpoint(str(tmp_path / "ckpt2"), str(tmp_path / "out2"))


_SURGERY = """\
import sys, torch
path = sys.argv[1]
sd = torch.load(path, weights_only=False)
flat = sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
flat.data[0] += 1.0  # the tied embedding leads the stage's group
torch.save(sd, path)
"""


def test_tied_copies_that_differ_are_refused(pipe_ckpt, tmp_path) -> None:
    """Stage 1's master copy of the tied embedding edited: the stages come from two saves."""
    tag = _copy(pipe_ckpt, "pp2-fp32-tied", tmp_path / "ckpt")
    target = tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    env = dict(os.environ, DS_ACCELERATOR="cpu")  # the pickle names DeepSpeed classes
    subprocess.run([sys.executable, "-c", _SURGERY, str(target)], check=True, env=env)
    with pytest.raises(
        LayoutMismatchError, match=f"stage 1's master copy of the tied param '{TIED}'"
    ):
        convert_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"))


def test_pipeline_without_zero_is_refused(pipe_ckpt, tmp_path) -> None:
    """ZeRO stage 0 (fp32/fp16) writes no optimizer files: the weights are elsewhere."""
    from zerosafe.errors import UnsupportedCheckpointError

    tag = _copy(pipe_ckpt, "pp2-fp32-tied", tmp_path / "ckpt")
    for f in tag.glob("*_optim_states.pt"):
        f.unlink()
    with pytest.raises(UnsupportedCheckpointError, match="PipelineModule trained without ZeRO"):
        convert_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"))
