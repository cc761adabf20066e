"""`--to universal` carries the HF Trainer's own files (issue 39): the real Trainer, under
real DeepSpeed ZeRO-3 on two CPU ranks, saves `checkpoint-2/`; zerosafe turns it universal;
the real Trainer resumes from that output at world size 1 with nothing copied by hand, at
step 2 (not 0), from the saved weights bit for bit, and trains on to step 4."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from tests.deepspeed_gen import _LAUNCHER, HF_SCRIPT, _env, _free_port, _tail, train_checkpoint
from zerosafe.training_state import convert_to_universal
from zerosafe.training_state.universal import verify_universal_output

pytestmark = pytest.mark.slow

RESUME_SCRIPT = Path(__file__).with_name("trainer_resume.py")
SPEC = {"trainer": True, "arch": "llama", "stage": 3, "precision": "fp32", "world_size": 2,
        "steps": 2, "seed": 5}  # fmt: skip
SAVED = "checkpoint-2"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Trainer's own save: `ckpt/checkpoint-2/` (DeepSpeed's files and the Trainer's);
    the live weights at `live.safetensors` beside `ckpt/`."""
    dest = tmp_path_factory.mktemp("trainer-z3")
    ckpt = train_checkpoint(SPEC, dest, script=HF_SCRIPT)
    return ckpt / SAVED


@pytest.fixture(scope="module")
def universal(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("trainer-universal") / "out"
    summary = convert_to_universal(str(trained), str(out))
    return out, summary.notes


def _resume(spec_file: Path, load_dir: Path, out_dir: Path, world_size: int) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc_per_node", str(world_size), "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), "--no-python", sys.executable, "-c", _LAUNCHER,
        str(RESUME_SCRIPT), str(spec_file), str(load_dir), str(out_dir),
    ]  # fmt: skip
    log = out_dir.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), timeout=600)
    assert rc.returncode == 0, _tail(log)
    return json.loads((out_dir / "resumed.json").read_text())


def test_carries_the_trainers_files(trained: Path, universal: tuple[Path, list[str]]) -> None:
    out, notes = universal
    saved = {p.name for p in trained.iterdir() if p.is_file()}
    # what transformers 5 wrote here (one `rng_state.pth`: its TrainingArguments count one
    # process on these CPU ranks; `scheduler.pt` only where DeepSpeed holds no scheduler)
    assert {"trainer_state.json", "training_args.bin", "config.json"} <= saved
    rng = sorted(n for n in saved if n.startswith("rng_state"))
    assert rng
    carried = ["trainer_state.json", "training_args.bin", "config.json", *rng]
    carried += [n for n in ("scheduler.pt", "generation_config.json") if n in saved]
    for name in carried:
        assert (out / name).read_bytes() == (trained / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == sorted(
        [*carried, "latest_universal", "zerosafe-universal-complete.json"]
    )  # never DeepSpeed's `latest` or scripts
    said = "\n".join(notes)
    assert "carried `trainer_state.json`" in said and f"`{rng[0]}`" in said


def test_verify_checks_the_carried_files(universal: tuple[Path, list[str]]) -> None:
    out, _ = universal
    assert verify_universal_output(str(out))["ok"]
    state = out / "trainer_state.json"
    original = state.read_bytes()
    try:
        state.write_bytes(original.replace(b'"global_step": 2', b'"global_step": 9'))
        found = verify_universal_output(str(out))
        assert not found["ok"]
        assert [f["file"] for f in found["failures"]] == ["trainer_state.json"]
    finally:
        state.write_bytes(original)


def test_trainer_resumes_at_another_world_size(
    trained: Path, universal: tuple[Path, list[str]], tmp_path: Path
) -> None:
    out, _ = universal
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(SPEC))
    found = _resume(spec_file, out, tmp_path / "resumed", world_size=1)
    # the Trainer took its step count from the carried trainer_state.json
    assert found["begin_step"] == SPEC["steps"]
    assert found["final_step"] == 2 * SPEC["steps"]
    logged = [e["step"] for e in found["log_history"] if "loss" in e]
    assert logged == [1, 2, 3, 4]
    # and DeepSpeed loaded the universal masters: the weights the saving run ended with
    live = load_file(str(trained.parents[1] / "live.safetensors"))
    begin = load_file(str(tmp_path / "resumed" / "begin.safetensors"))
    assert sorted(begin) == sorted(live)
    for name, value in live.items():
        assert begin[name].tobytes() == value.tobytes(), name


def test_to_dcp_carries_them_too(trained: Path, tmp_path: Path) -> None:
    from zerosafe.training_state import convert_to_dcp
    from zerosafe.training_state.dcp import verify_dcp_output

    out = tmp_path / "dcp"
    summary = convert_to_dcp(str(trained), str(out), layout="accelerate")
    assert "carried `trainer_state.json`" in "\n".join(summary.notes)
    for name in ("trainer_state.json", "training_args.bin", "config.json"):
        assert (out / name).read_bytes() == (trained / name).read_bytes(), name
    assert verify_dcp_output(str(out))["ok"]
    (out / "training_args.bin").write_bytes(b"changed")
    found = verify_dcp_output(str(out))
    assert [f["file"] for f in found["failures"]] == ["training_args.bin"]
