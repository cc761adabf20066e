"""`zerosafe convert CKPT OUT --to universal` (issue 25) against real DeepSpeed 0.19.8 on CPU.

Checkpoints trained at world size 4 (ZeRO-1 bf16 with tied and frozen params and two param
groups; the same with BF16_Optimizer; ZeRO-2 fp32 with ZeRO-Offload's DeepSpeedCPUAdam; ZeRO-3
bf16 with tied and frozen params and sub-groups), plus three shared fixtures (ZeRO-2 fp16 with
its dynamic loss scaler, ZeRO-3 fp32 with two groups, BF16_Optimizer at world size 2), are
turned universal by zerosafe and by DeepSpeed's own `ds_to_universal.py`. Then:

- every file's tensors are equal, bit for bit, and so are the fields of `optimizer_state.pt`
  DeepSpeed's loader reads;
- DeepSpeed resumes from both at world sizes 2 and 3 (`"checkpoint": {"load_universal":
  true}`, `engine.load_checkpoint(OUT)`): every rank's fp32 partitions and moments as loaded,
  and the losses and partitions of the next steps, are bit-identical;
- a conversion SIGKILLed midway resumes: no finished unit is redone, the output is identical;
- `round_robin_gradients` (which `ds_to_universal.py` misplaces) matches the live weights.

Starting DeepSpeed costs far more than these tiny models: every DeepSpeed run below handles
all checkpoints at once. Set ZEROSAFE_DS_CACHE=/some/dir to keep the trained checkpoints.
"""

from __future__ import annotations

import json
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
from safetensors.torch import load_file

from tests.conftest import SHARED_FIXTURES
from tests.deepspeed_gen import resume_universal
from tests.training_state.conftest import SHARED, TRAINED, Source, shared_checkpoint
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import Storage
from zerosafe.training_state import convert_to_universal
from zerosafe_app.cli import main

pytestmark = pytest.mark.slow

ROUND_ROBIN = "z2-fp32-ws3-frozen-2groups-roundrobin"
RESUME_WORLD_SIZES = [2, 3]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ours(sources: dict[str, Source], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """zerosafe's universal output of every source, by the command (in this process)."""
    tmp = tmp_path_factory.mktemp("uc-ours")
    out = {}
    for name, s in sources.items():
        out[name] = tmp / name
        assert (
            main(
                [
                    "convert",
                    str(s.ckpt),
                    str(out[name]),
                    "--to",
                    "universal",
                    "--via",
                    "local",
                    "-q",
                ]
            )
            == 0
        )
    return out


@pytest.fixture(scope="session")
def resumed(
    sources: dict[str, Source], ours: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[int, str], tuple[Path, Path]]:
    """`(world size, name) -> (records resumed from ours, from ds_to_universal's)`: one
    torchrun per world size resumes every trained checkpoint from both outputs."""
    tmp = tmp_path_factory.mktemp("uc-resume")
    found = {}
    for ws in RESUME_WORLD_SIZES:
        jobs = []
        for name in TRAINED:
            spec = sources[name].spec
            assert spec is not None
            jobs += [(spec, ours[name]), (spec, sources[name].ds)]
        outs = resume_universal(jobs, ws, tmp / f"ws{ws}")
        for i, name in enumerate(TRAINED):
            found[(ws, name)] = (outs[2 * i], outs[2 * i + 1])
    return found


# -- helpers --------------------------------------------------------------------------------


def assert_same(a: Any, b: Any, path: str) -> None:
    """Equal values; tensors equal bit for bit, with the same dtype, shape, requires_grad."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b), path
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), (
            f"{path}: {a.dtype} {tuple(a.shape)} grad={a.requires_grad} vs "
            f"{b.dtype} {tuple(b.shape)} grad={b.requires_grad}"
        )
        bits = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*bits), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):  # DeepSpeed's loss scalers
        assert type(a) is type(b) and vars(a) == vars(b), f"{path}: {a!r} vs {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} vs {b!r}"


def _pt_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.pt"))


# -- (a) the files ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRAINED + SHARED)
def test_files_equal_ds_to_universal(
    name: str, sources: dict[str, Source], ours: dict[str, Path]
) -> None:
    s = sources[name]
    out = ours[name]
    assert (out / "latest_universal").read_text() == f"{s.tag}_universal"
    assert (out / "zerosafe-universal-complete.json").is_file()
    assert not (out / ".zerosafe-work").exists()
    mine, theirs = out / f"{s.tag}_universal", s.ds_folder
    assert _pt_files(mine) == _pt_files(theirs)
    for rel in _pt_files(theirs):
        if rel == "zero/optimizer_state.pt":
            continue
        if not rel.startswith("zero/"):  # the model states: copied unchanged
            assert (mine / rel).read_bytes() == (theirs / rel).read_bytes(), rel
            continue
        # what DeepSpeed's loader can open without trusting the file
        assert_same(
            torch.load(mine / rel, weights_only=True),
            torch.load(theirs / rel, weights_only=True),
            rel,
        )
    got = torch.load(mine / "zero/optimizer_state.pt", weights_only=False)
    want = torch.load(theirs / "zero/optimizer_state.pt", weights_only=False)
    if "fp32_flat_groups" in want:  # ZeRO-3: rank 0's partitions, which the loader never reads
        del want["fp32_flat_groups"]
        for state in want["optimizer_state_dict"]["state"].values():
            del state["exp_avg"], state["exp_avg_sq"]
    assert_same(got, want, "optimizer_state.pt")


def test_rerun_is_already_complete(
    sources: dict[str, Source], ours: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    name = TRAINED[0]
    args = ["convert", str(sources[name].ckpt), str(ours[name]), "--to", "universal"]
    assert main([*args, "--via", "local", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "already-complete"


def test_inspect_says_what_it_will_read(
    sources: dict[str, Source], capsys: pytest.CaptureFixture[str]
) -> None:
    """`inspect --to universal` costs the masters, the moments and the model states."""
    s = sources[TRAINED[0]]
    assert main(["inspect", str(s.ckpt), "--to", "universal", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["to"] == "universal" and report["folder"] == f"{s.tag}_universal"
    assert report["moments_bytes"] == 2 * report["masters_bytes"] > 0
    model_bytes = sum(p.stat().st_size for p in (s.ckpt / s.tag).glob("*model_states.pt"))
    assert report["model_states_bytes"] == model_bytes
    assert main(["inspect", str(s.ckpt), "--to", "universal"]) == 0
    assert "moments" in capsys.readouterr().out


# -- (b) DeepSpeed resumes ----------------------------------------------------------------------


@pytest.mark.parametrize("ws", RESUME_WORLD_SIZES)
@pytest.mark.parametrize("name", TRAINED)
def test_resume_is_bit_identical(
    ws: int, name: str, resumed: dict[tuple[int, str], tuple[Path, Path]]
) -> None:
    """Every rank, as loaded and after the next steps: partitions, moments, steps, losses."""
    mine, theirs = resumed[(ws, name)]
    for rank in range(ws):
        with (
            safe_open(str(mine / f"rank{rank}.safetensors"), "pt") as a,
            safe_open(str(theirs / f"rank{rank}.safetensors"), "pt") as b,
        ):
            losses = json.loads(a.metadata()["losses"])
            assert losses == json.loads(b.metadata()["losses"]), f"rank {rank}"
            assert len(losses) == 2
            keys = sorted(a.keys())
            assert keys == sorted(b.keys())
            # the state was loaded (a fresh optimizer has none): the saved step count is back
            steps = [a.get_tensor(k).item() for k in keys if k.startswith("loaded.step.")]
            assert steps and all(step == 2 for step in steps), steps
            assert any(k.startswith("loaded.exp_avg_sq.") for k in keys), keys
            for key in keys:
                assert_same(a.get_tensor(key), b.get_tensor(key), f"rank {rank} {key}")


# -- resume after SIGKILL ----------------------------------------------------------------------

_KILL_AFTER = """
import os, signal, sys
from zerosafe.training_state import universal

ckpt, out, after = sys.argv[1], sys.argv[2], int(sys.argv[3])
write_param = universal._Job.write_param
done = []

def write_then_die(self, param):
    if len(done) == after:
        os.kill(os.getpid(), signal.SIGKILL)
    done.append(param.name)
    return write_param(self, param)

universal._Job.write_param = write_then_die
universal.convert_to_universal(ckpt, out, unit_bytes=1, parallel=1)  # one unit at a time
"""


def test_sigkill_midway_then_resume(
    sources: dict[str, Source], ours: dict[str, Path], tmp_path: Path
) -> None:
    """Killed in its 6th param unit (one param per unit): the rerun keeps the optimizer state,
    the model states copies and the first five params, writes only the rest, and the output
    equals an uninterrupted run's, byte for byte."""
    name = TRAINED[2]
    s = sources[name]
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILL_AFTER), str(s.ckpt), str(out), "5"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (out / "zerosafe-universal-complete.json").exists()
    assert not (out / "latest_universal").exists()
    units = next((out / ".zerosafe-work").iterdir()) / "units"
    before = {p.name: p.stat().st_mtime_ns for p in units.glob("universal-*.json")}
    assert len(before) == 2 + 5

    # chunks of 25 elements: every param streams through many reads and writes
    summary = convert_to_universal(
        str(s.ckpt), str(out), unit_bytes=1, chunk_bytes=100, keep_work=True
    )
    num_params = summary.num_params
    assert (summary.units_kept, summary.units_run) == (7, num_params - 5)
    after = {p.name: p.stat().st_mtime_ns for p in units.glob("universal-*.json")}
    assert {k: after[k] for k in before} == before  # kept records were not written again
    assert len(after) == 2 + num_params
    assert not list(out.rglob("*.partial"))
    mine, reference = out / f"{s.tag}_universal", ours[name] / f"{s.tag}_universal"
    assert _pt_files(mine) == _pt_files(reference)
    for rel in _pt_files(reference):
        assert (mine / rel).read_bytes() == (reference / rel).read_bytes(), rel


# -- what ds_to_universal gets wrong, and what is refused ------------------------------------


def test_round_robin_params_match_live_weights(tmp_path: Path) -> None:
    """`round_robin_gradients` reorders params in the flat groups; `ds_to_universal.py` places
    them by `param_slice_mappings`, which disagree with the bytes. zerosafe places them by
    `param_shapes`: every `fp32.pt` equals the live fp32 weights of the run."""
    ckpt = shared_checkpoint(ROUND_ROBIN)
    live = load_file(str(SHARED_FIXTURES / ROUND_ROBIN / "golden" / "live_params_lowp.safetensors"))
    summary = convert_to_universal(str(ckpt), str(tmp_path / "out"))
    zero = tmp_path / "out" / f"{(ckpt / 'latest').read_text().strip()}_universal" / "zero"
    trained = [p for p in zero.iterdir() if (p / "exp_avg.pt").is_file()]
    assert len(trained) == summary.num_params > 0
    for folder in trained:
        got = torch.load(folder / "fp32.pt", weights_only=True)["param"]
        assert_same(got.detach(), live[folder.name].float(), folder.name)
        moment = torch.load(folder / "exp_avg_sq.pt", weights_only=True)["param"]
        assert moment.shape == got.shape and bool((moment >= 0).all()), folder.name


def test_verify_checks_a_universal_output(
    sources: dict[str, Source],
    ours: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`zerosafe verify OUT` re-checks every file; one flipped byte in a master fails it."""
    name = TRAINED[2]
    out = tmp_path / "out"
    shutil.copytree(ours[name], out)
    assert main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith("OK ")
    target = out / f"{sources[name].tag}_universal" / "zero" / "embed.weight" / "fp32.pt"
    zf = TorchZipFile(Storage().open_source(str(target)))
    at = zf.data_offset(zf.storage_record("0")) + 5
    raw = bytearray(target.read_bytes())
    raw[at] ^= 0x40
    target.write_bytes(bytes(raw))
    assert main(["verify", str(out)]) == 1
    report = capsys.readouterr().out
    assert report.startswith("FAILED ") and "embed.weight/fp32.pt" in report and "CRC-32" in report
