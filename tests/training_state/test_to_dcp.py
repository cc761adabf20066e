"""`zerosafe convert CKPT OUT --to dcp` (issue 25) against real DeepSpeed 0.19.8 checkpoints
and real FSDP2 on CPU (gloo).

The shared DeepSpeed fixtures (ZeRO-1 bf16 with tied and frozen params and two groups,
BF16_Optimizer, ZeRO-2 fp16 with skipped steps, ZeRO-3 fp32 with two groups, ZeRO-3 bf16 with
tied and frozen params and sub-groups) are converted `--to dcp`; DeepSpeed's own
`ds_to_universal.py` gives the reference masters, moments and steps. Then an FSDP2
(`fully_shard`) run of a module with the same params, tied aliases, frozen params, buffers and
param groups loads each at world sizes 1 and 2 with `get_state_dict` -> `dcp.load` ->
`set_state_dict` (`fsdp2_resume.py`, one torchrun per world size for all checkpoints):

- every param equals DeepSpeed's fp32 master bit for bit (frozen ones: the saved 16-bit
  values, made float32), every buffer its saved value, every `exp_avg`/`exp_avg_sq`/`step`
  DeepSpeed's, and the param groups carry the checkpoint's hyperparameters;
- the `.metadata` zerosafe wrote has exactly the keys, sizes, dtypes and nested-dict paths of
  the one torch writes (`dcp.save`) for the same FSDP2 model and optimizer;
- a further `optimizer.step()` runs: step + 1, trained params move, frozen ones do not;
- a conversion SIGKILLed midway resumes without redoing finished units, output identical.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tests.conftest import SHARED_FIXTURES
from tests.deepspeed_gen import ds_to_universal_many
from tests.training_state.conftest import Source
from zerosafe.training_state.dcp import convert_to_dcp
from zerosafe_app.cli import main

pytestmark = pytest.mark.slow

CASES = [
    "z1-bf16-ws4-tied-frozen-2groups",
    "z1-bf16-ws2-fp32accum-bf16optimizer",
    "z2-fp16-ws4-tied",
    "z3-fp32-ws4-tied-2groups-persist",
    "z3-bf16-ws2-tied-frozen-2groups-subgroups",
]
WORLD_SIZES = [1, 2]
ACCELERATE = [CASES[0], CASES[4]]
"""Also converted with `--dcp-layout accelerate` and loaded as accelerate loads FSDP2 state."""
REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("fsdp2_resume.py")


def _root(name: str) -> Path:
    root = SHARED_FIXTURES / name
    if not (root / "checkpoint").is_dir():
        pytest.skip(f"shared fixture {name} is absent ({SHARED_FIXTURES})")
    return root


def _module_spec(root: Path) -> dict[str, Any]:
    """The DeepSpeed run's module, as its manifest and live weights describe it."""
    model = json.loads((root / "manifest.json").read_text())["model"]
    with safe_open(str(root / "golden" / "live_params_lowp.safetensors"), "pt") as f:
        shapes = {n: list(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    tied = dict(model["tied_params"])
    frozen = set(model["frozen_params"])
    params = [
        [n, shapes[tied.get(n, n)], n not in frozen]
        for n, _ in model["named_parameters_including_tied"]
    ]
    buffers = [
        [n, shapes[n], model["buffer_dtypes_in_checkpoint"][n].removeprefix("torch.")]
        for n in model["buffers"]
    ]
    return {
        "module": {"params": params, "tied": tied, "buffers": buffers},
        "groups": [g["params"] for g in model["optimizer_param_groups"]],
    }


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Each case: `ckpt`, `root`, `dcp` (zerosafe's output, by the command), `ds`
    (ds_to_universal.py's universal folder, all cases in one DeepSpeed process)."""
    tmp = tmp_path_factory.mktemp("dcp")
    out: dict[str, dict[str, Path]] = {}
    for name in CASES:
        root = _root(name)
        ckpt = root / "checkpoint"
        tag = (ckpt / "latest").read_text().strip()
        dest = tmp / name / "dcp"
        args = ["convert", str(ckpt), str(dest), "--to", "dcp", "--via", "local", "-q"]
        assert main(args) == 0
        out[name] = {"root": root, "ckpt": ckpt, "dcp": dest, "ds": tmp / name / f"{tag}_universal"}
        if name in ACCELERATE:
            out[name]["accelerate"] = tmp / name / "accelerate"
            assert main([*args[:2], str(out[name]["accelerate"]), *args[3:],
                         "--dcp-layout", "accelerate"]) == 0  # fmt: skip
    ds_to_universal_many([(c["ckpt"] / c["ds"].name.removesuffix("_universal"), c["ds"])
                          for c in out.values()])  # fmt: skip
    return out


@pytest.fixture(scope="session")
def resumed(
    converted: dict[str, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[int, str], Path]:
    """`(world size, case) ->` the folder of `loaded.pt`, `stepped.pt` and `torch_dcp/`."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    found = {}
    for ws in WORLD_SIZES:
        jobs = []
        for name, c in converted.items():
            found[(ws, name)] = tmp / f"ws{ws}" / name
            jobs.append(
                {"dcp": str(c["dcp"]), "out": str(found[(ws, name)]), **_module_spec(c["root"])}
            )
            if "accelerate" in c:
                found[(ws, f"{name}/accelerate")] = tmp / f"ws{ws}" / name / "accelerate"
                jobs.append({
                    "dcp": str(c["accelerate"]), "out": str(found[(ws, f"{name}/accelerate")]),
                    "layout": "accelerate", **_module_spec(c["root"]),
                })  # fmt: skip
        jobs_file = tmp / f"jobs-ws{ws}.json"
        jobs_file.write_text(json.dumps(jobs))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ws}", str(SCRIPT), str(jobs_file)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return found


# -- the reference: DeepSpeed's own ----------------------------------------------------------


def _deepspeed_state(c: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    """`fqn -> {fp32, exp_avg, exp_avg_sq, step}` of every trained param, from
    ds_to_universal.py's output (ZeRO-3: flat tensors, put in the param's shape here)."""
    zero = c["ds"] / "zero"
    osd = torch.load(zero / "optimizer_state.pt", weights_only=False)
    z3_steps = {
        float(s["step"]) for s in osd.get("optimizer_state_dict", {}).get("state", {}).values()
    }
    out = {}
    for folder in sorted(p for p in zero.iterdir() if (p / "exp_avg.pt").is_file()):
        states = {}
        for s in ("fp32", "exp_avg", "exp_avg_sq"):
            t = torch.load(folder / f"{s}.pt", weights_only=True)
            states[s] = t["param"] if isinstance(t, dict) else t
        if (folder / "step.pt").is_file():
            states["step"] = torch.tensor(float(torch.load(folder / "step.pt", weights_only=True)))
        else:
            assert len(z3_steps) == 1, z3_steps
            states["step"] = torch.tensor(next(iter(z3_steps)))
        out[folder.name] = states
    return out


def _hyper(c: dict[str, Path]) -> list[dict[str, Any]]:
    osd = torch.load(c["ds"] / "zero" / "optimizer_state.pt", weights_only=False)
    return [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]


def bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
    )
    assert torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    ), f"{what}: bytes differ"


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", CASES)
def test_fsdp2_loads_deepspeeds_state(
    ws: int, name: str, converted: dict[str, dict[str, Path]], resumed: dict[tuple[int, str], Path]
) -> None:
    c = converted[name]
    spec = _module_spec(c["root"])
    loaded = torch.load(resumed[(ws, name)] / "loaded.pt", weights_only=False)
    ds = _deepspeed_state(c)
    with safe_open(str(c["root"] / "golden" / "live_params_lowp.safetensors"), "pt") as f:
        live = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    tied = spec["module"]["tied"]
    model, optim = loaded["model"], loaded["optim"]
    names = [n for n, _, _ in spec["module"]["params"]] + [n for n, *_ in spec["module"]["buffers"]]
    assert sorted(model) == sorted(names)
    trained = [n for n, _, grad in spec["module"]["params"] if grad and n not in tied]
    assert sorted(ds) == sorted(trained) and sorted(optim["state"]) == sorted(trained)
    for n, _, grad in spec["module"]["params"]:
        source = tied.get(n, n)
        want = ds[source]["fp32"] if grad else live[source].float()
        bits_equal(model[n].reshape(want.shape), want, f"model.{n}")
        assert model[n].shape == torch.Size(live[source].shape)
    for n, *_ in spec["module"]["buffers"]:
        bits_equal(model[n], live[n], f"model.{n}")
    for n in trained:
        for s in ("exp_avg", "exp_avg_sq", "step"):
            want = ds[n][s]
            got = optim["state"][n][s]
            bits_equal(got.reshape(want.shape), want, f"optim.state.{n}.{s}")
    hyper = _hyper(c)
    assert len(optim["param_groups"]) == len(spec["groups"]) == len(hyper)
    for group, fqns, want in zip(optim["param_groups"], spec["groups"], hyper, strict=True):
        assert group["params"] == fqns
        assert {k: v for k, v in group.items() if k != "params"} == want


@pytest.mark.parametrize("name", CASES)
def test_layout_is_torchs_own(
    name: str, converted: dict[str, dict[str, Path]], resumed: dict[tuple[int, str], Path]
) -> None:
    """zerosafe's `.metadata` against the one `dcp.save` writes for the FSDP2 model and
    optimizer that loaded it: the same keys, kinds, sizes, dtypes and nested-dict paths."""
    ours = pickle.loads((converted[name]["dcp"] / ".metadata").read_bytes())
    for ws in WORLD_SIZES:
        theirs = pickle.loads((resumed[(ws, name)] / "torch_dcp" / ".metadata").read_bytes())
        assert sorted(ours.state_dict_metadata) == sorted(theirs.state_dict_metadata)
        for key, want in theirs.state_dict_metadata.items():
            got = ours.state_dict_metadata[key]
            assert type(got) is type(want), key
            if hasattr(want, "size"):
                assert (got.size, got.properties.dtype) == (want.size, want.properties.dtype), key
        assert ours.planner_data == theirs.planner_data
        assert ours.version == theirs.version


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", CASES)
def test_a_further_step_runs(
    ws: int, name: str, converted: dict[str, dict[str, Path]], resumed: dict[tuple[int, str], Path]
) -> None:
    spec = _module_spec(converted[name]["root"])
    loaded = torch.load(resumed[(ws, name)] / "loaded.pt", weights_only=False)
    stepped = torch.load(resumed[(ws, name)] / "stepped.pt", weights_only=False)
    for fqn, state in stepped["optim"]["state"].items():
        assert float(state["step"]) == float(loaded["optim"]["state"][fqn]["step"]) + 1
    for n, _, grad in spec["module"]["params"]:
        a, b = loaded["model"][n], stepped["model"][n]
        assert bool(torch.isfinite(b).all()), n
        assert (not torch.equal(a, b)) if grad else torch.equal(a, b), n


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", ACCELERATE)
def test_accelerate_layout_loads_the_same_state(
    ws: int, name: str, converted: dict[str, dict[str, Path]], resumed: dict[tuple[int, str], Path]
) -> None:
    """`--dcp-layout accelerate`: the two folders accelerate saves FSDP2 state into, loaded
    as accelerate loads them, give the very state `--to dcp`'s default layout gives (checked
    against DeepSpeed above); their `.metadata` keys are torch's under accelerate's keys."""
    out = converted[name]["accelerate"]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "optimizer_0", "pytorch_model_fsdp_0"
    ]  # fmt: skip
    assert not (out / ".metadata").exists()
    a = torch.load(resumed[(ws, name)] / "loaded.pt", weights_only=False)
    b = torch.load(resumed[(ws, f"{name}/accelerate")] / "loaded.pt", weights_only=False)
    for key in a["model"]:
        bits_equal(a["model"][key], b["model"][key], key)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    for fqn, state in a["optim"]["state"].items():
        for s, t in state.items():
            bits_equal(t, b["optim"]["state"][fqn][s], f"{fqn}.{s}")
    theirs = pickle.loads((resumed[(ws, name)] / "torch_dcp" / ".metadata").read_bytes())
    model = pickle.loads((out / "pytorch_model_fsdp_0" / ".metadata").read_bytes())
    optim = pickle.loads((out / "optimizer_0" / ".metadata").read_bytes())
    assert sorted(model.state_dict_metadata) == sorted(
        k for k in theirs.state_dict_metadata if k.startswith("model.")
    )
    assert sorted(optim.state_dict_metadata) == sorted(
        "optimizer." + k.removeprefix("optim.")
        for k in theirs.state_dict_metadata
        if k.startswith("optim.")
    )


def test_inspect_and_rerun_and_verify(
    converted: dict[str, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    c = converted[CASES[0]]
    assert main(["inspect", str(c["ckpt"]), "--to", "dcp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["to"] == "dcp" and report["moments_bytes"] == 2 * report["masters_bytes"] > 0
    assert report["read_bytes"] >= report["masters_bytes"] + report["moments_bytes"]
    assert main(["inspect", str(c["ckpt"]), "--to", "dcp"]) == 0
    assert "moments" in capsys.readouterr().out
    args = ["convert", str(c["ckpt"]), str(c["dcp"]), "--to", "dcp", "--via", "local", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "already-complete"
    out = tmp_path / "out"
    shutil.copytree(c["dcp"], out)
    assert main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith("OK ")
    target = max(out.glob("__*_0.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    target.write_bytes(bytes(raw))
    assert main(["verify", str(out)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_refusals(
    converted: dict[str, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(converted[CASES[0]]["ckpt"])
    assert main(["convert", ckpt, str(tmp_path / "a"), "--to", "dcp", "--work-dir", "w"]) == 2
    assert "`--work-dir` does not apply with `--to dcp`" in capsys.readouterr().err
    assert main(["convert", ckpt, str(tmp_path / "b"), "--to", "dcp", "--dtype", "bf16"]) == 2
    assert "`--dtype` does not apply with `--to dcp`" in capsys.readouterr().err
    assert main(["inspect", ckpt, "--dcp-layout", "accelerate"]) == 2
    assert "`--dcp-layout` applies only with `--to dcp`" in capsys.readouterr().err
    assert main(["inspect", ckpt, "--to", "universal", "--dcp-layout", "accelerate"]) == 2
    assert "`--dcp-layout` applies only with `--to dcp`" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / ".metadata").write_bytes(b"x")
    assert main(["convert", ckpt, str(foreign), "--to", "dcp", "--via", "local"]) == 2
    assert "did not write" in capsys.readouterr().err


_KILL_AFTER = """
import os, signal, sys
from zerosafe.training_state import dcp

ckpt, out, after = sys.argv[1], sys.argv[2], int(sys.argv[3])
write_unit = dcp._Job.write_unit
done = []

def write_then_die(self, index, items):
    if len(done) == after:
        os.kill(os.getpid(), signal.SIGKILL)
    done.append(index)
    return write_unit(self, index, items)

dcp._Job.write_unit = write_then_die
dcp.convert_to_dcp(ckpt, out, unit_bytes=1, parallel=1)  # one unit at a time: the kill lands in one
"""


def test_sigkill_midway_then_resume(converted: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    """Killed in its 6th unit (one tensor per unit): the rerun keeps the first five, writes the
    rest, and every `.distcp` file equals an uninterrupted run's, byte for byte."""
    c = converted[CASES[3]]
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILL_AFTER), str(c["ckpt"]), str(out), "5"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (out / ".metadata").exists() and not (out / "zerosafe-dcp-complete.json").exists()
    units = next((out / ".zerosafe-work").iterdir()) / "units"
    before = {p.name: p.stat().st_mtime_ns for p in units.glob("dcp-*.json")}
    assert len(before) == 5
    summary = convert_to_dcp(str(c["ckpt"]), str(out), unit_bytes=1, chunk_bytes=100)
    assert summary.units_kept == 5 and summary.units_run > 0
    reference = tmp_path / "reference"
    convert_to_dcp(str(c["ckpt"]), str(reference), unit_bytes=1)
    files = sorted(p.name for p in reference.glob("__*.distcp"))
    assert files == sorted(p.name for p in out.glob("__*.distcp"))
    for f in files:
        assert (out / f).read_bytes() == (reference / f).read_bytes(), f
    ours = pickle.loads((out / ".metadata").read_bytes())
    theirs = pickle.loads((reference / ".metadata").read_bytes())
    assert ours.storage_data == theirs.storage_data
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert not list(out.rglob("*.partial")) and not (out / ".zerosafe-work").exists()


def test_zerosafes_dcp_reader_reads_it_back(
    converted: dict[str, dict[str, Path]], resumed: dict[tuple[int, str], Path], tmp_path: Path
) -> None:
    """A second reader of the format: zerosafe's own DCP -> safetensors conversion of the
    output gives every model entry FSDP2 loaded, bit for bit."""
    from safetensors.torch import load_file

    name = CASES[4]
    out = tmp_path / "st"
    assert main(["convert", str(converted[name]["dcp"]), str(out), "--via", "local", "-q"]) == 0
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(str(f)))
    loaded = torch.load(resumed[(1, name)] / "loaded.pt", weights_only=False)["model"]
    assert sorted(got) == sorted(loaded)  # a tied alias too: DCP stores it under both names
    for n, t in got.items():
        bits_equal(t, loaded[n], n)


# -- DeepSpeedCPUAdam (ZeRO-Offload), from the trained checkpoints test_to_universal.py shares --

CPU_ADAM = "uc-z2-fp32-ws4-cpuadam"


def _spec_from_model_states(ckpt: Path, tag: str) -> dict[str, Any]:
    """A ZeRO-1/2 run's module and param groups, from DeepSpeed's own rank-0 model states."""
    states = torch.load(
        ckpt / tag / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu"
    )
    buffers = set(states["buffer_names"])
    frozen = set(states.get("frozen_param_shapes") or {})
    tied = dict(states.get("shared_params") or {})
    module = states["module"]
    return {
        "module": {
            "params": [[n, list(t.shape), n not in frozen] for n, t in module.items()
                       if n not in buffers],
            "tied": tied,
            "buffers": [[n, list(module[n].shape), str(module[n].dtype).removeprefix("torch.")]
                        for n in module if n in buffers],
        },
        "groups": [list(g) for g in states["param_shapes"]],
    }  # fmt: skip


def test_fsdp2_loads_deepspeed_cpu_adam_state(sources: dict[str, Source], tmp_path: Path) -> None:
    """DeepSpeedCPUAdam saves its own param group keys and an int step: FSDP2's AdamW gets
    torch's keys (AdamW mode, DeepSpeed's hyperparameters) and a float32 step, and every
    master, moment and step equals ds_to_universal.py's, at world size 2."""
    s = sources[CPU_ADAM]
    out = tmp_path / "dcp"
    assert main(["convert", str(s.ckpt), str(out), "--to", "dcp", "--via", "local", "-q"]) == 0
    spec = _spec_from_model_states(s.ckpt, s.tag)
    job = {"dcp": str(out), "out": str(tmp_path / "resumed"), **spec}
    (tmp_path / "jobs.json").write_text(json.dumps([job]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(SCRIPT), str(tmp_path / "jobs.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    loaded = torch.load(tmp_path / "resumed" / "loaded.pt", weights_only=False)
    ds = _deepspeed_state({"ds": s.ds_folder})
    assert sorted(loaded["optim"]["state"]) == sorted(ds)
    for n, states in ds.items():
        bits_equal(loaded["model"][n], states["fp32"].detach(), n)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            bits_equal(loaded["optim"]["state"][n][key], states[key], f"{n}.{key}")
    (group,) = loaded["optim"]["param_groups"]
    saved = torch.load(s.ds_folder / "zero" / "optimizer_state.pt", weights_only=False)
    (want,) = saved["param_groups"]
    assert "decoupled_weight_decay" not in want and want["bias_correction"] is True
    assert group["decoupled_weight_decay"] is True and group["params"] == spec["groups"][0]
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad"):
        assert group[key] == want[key], key
    stepped = torch.load(tmp_path / "resumed" / "stepped.pt", weights_only=False)
    assert all(float(v["step"]) == float(ds[n]["step"]) + 1
               for n, v in stepped["optim"]["state"].items())  # fmt: skip
