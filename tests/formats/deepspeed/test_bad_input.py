"""Bad input: one readable error naming the file and the fix, exit code 2, nothing complete."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_refused_in_one_line, zerosafe_child
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import (
    CheckpointFormatError,
    IntegrityError,
    LayoutMismatchError,
    OutputExistsError,
    UnsafePickleError,
    UnsupportedCheckpointError,
)
from zerosafe_app.cli import main

TAG = "global_step2"


def _optim(ckpt: Path, rank: int) -> Path:
    return ckpt / TAG / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _model(ckpt: Path, rank: int) -> Path:
    return ckpt / TAG / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def _convert_fails(ckpt: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    code = main(["convert", "--via", "local", str(ckpt), str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("zerosafe: error: ") and err.count("\n") == 1, err
    assert not (out / "zerosafe-complete.json").exists()
    assert not (out / "model.safetensors.index.json").exists()
    return err


def test_missing_rank_file(sample_ckpt: Path, tmp_path: Path, capsys) -> None:
    _optim(sample_ckpt, 1).unlink()
    err = _convert_fails(sample_ckpt, tmp_path / "out", capsys)
    assert "rank(s) [1] missing (bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt)" in err
    assert "Copy the whole tag folder" in err
    with pytest.raises(CheckpointFormatError, match=r"optimizer file for rank\(s\) \[1\] missing"):
        convert_checkpoint(str(sample_ckpt), str(tmp_path / "out2"))


def test_stale_rank_files_from_a_larger_run(sample_ckpt: Path, tmp_path: Path, capsys) -> None:
    for rank in (3, 4):
        shutil.copy(_optim(sample_ckpt, 2), _optim(sample_ckpt, rank))
    err = _convert_fails(sample_ckpt, tmp_path / "out", capsys)
    assert "stale optimizer files for rank(s) [3, 4]" in err
    assert "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt" in err and "Move them out" in err


def test_world_sizes_disagree(sample_ckpt: Path, tmp_path: Path, capsys) -> None:
    # Test-only fixture surgery: the model states of this checkpoint hold no DeepSpeed classes.
    path = _model(sample_ckpt, 0)
    states = torch.load(path, weights_only=True)
    states["dp_world_size"] = 4
    torch.save(states, path)
    err = _convert_fails(sample_ckpt, tmp_path / "out", capsys)
    assert "dp_world_size=4" in err and "partitioned over 3 ranks" in err and str(path) in err


def test_truncated_file(sample_ckpt: Path, tmp_path: Path, capsys) -> None:
    path = _optim(sample_ckpt, 2)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    err = _convert_fails(sample_ckpt, tmp_path / "out", capsys)
    assert str(path) in err and "truncated" in err


@pytest.mark.parametrize("direct", [False, True])
def test_flipped_bit_in_fp32_data_fails_the_crc(
    sample_ckpt: Path, tmp_path: Path, direct: bool
) -> None:
    from zerosafe.formats.torch_zip import TorchZipFile
    from zerosafe.io.storage import Storage

    path = _optim(sample_ckpt, 1)
    zf = TorchZipFile(Storage().open_source(str(path)))
    group = zf.load()["optimizer_state_dict"]["fp32_flat_groups"][0]
    offset = zf.tensor_offset(group) + 8
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))
    out = tmp_path / "out"
    with pytest.raises(IntegrityError, match=r"do not match their recorded CRC32.*zero_pp_rank_1"):
        convert_checkpoint(str(sample_ckpt), str(out), ConvertOptions(direct=direct))
    assert not (out / "zerosafe-complete.json").exists()


def _write_pt(path: Path, obj: object, **kw: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path, **kw)


def _fake_ckpt(tmp_path: Path, optim: object, *, legacy: bool = False) -> Path:
    ckpt = tmp_path / "fake"
    _write_pt(
        ckpt / TAG / "mp_rank_00_model_states.pt",
        {"param_shapes": [{"w": torch.Size([3])}], "module": {}, "dp_world_size": 1},
    )
    kw = {"_use_new_zipfile_serialization": False} if legacy else {}
    _write_pt(ckpt / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt", optim, **kw)
    (ckpt / "latest").write_text(TAG)
    return ckpt


@pytest.mark.parametrize(
    ("optim", "legacy", "error", "match"),
    [
        (
            {"optimizer_state_dict": {"state": {}, "param_groups": []}},
            False,
            CheckpointFormatError,
            "not a ZeRO checkpoint",
        ),
        ({"something": 1}, False, CheckpointFormatError, "no 'optimizer_state_dict'"),
        (
            {"optimizer_state_dict": {"zero_stage": 0, "partition_count": [1]}},
            False,
            UnsupportedCheckpointError,
            "ZeRO stage 0 is not supported",
        ),
        (  # a legacy (non-zip) file is read, and checked like any other
            {"optimizer_state_dict": {"state": {}, "param_groups": []}},
            True,
            CheckpointFormatError,
            "not a ZeRO checkpoint",
        ),
    ],
)
def test_files_that_are_not_zero_checkpoints(
    tmp_path: Path, capsys, optim, legacy, error, match
) -> None:
    ckpt = _fake_ckpt(tmp_path, optim, legacy=legacy)
    with pytest.raises(error, match=match) as e:
        convert_checkpoint(str(ckpt), str(tmp_path / "out"))
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in str(e.value)
    _convert_fails(ckpt, tmp_path / "out", capsys)


class _Evil:
    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_would_run_code_is_refused_and_nothing_runs(
    sample_ckpt: Path, tmp_path: Path, capsys
) -> None:
    marker = tmp_path / "ran"
    _Evil.marker = str(marker)
    torch.save({"optimizer_state_dict": {"zero_stage": _Evil()}}, _optim(sample_ckpt, 1))
    err = _convert_fails(sample_ckpt, tmp_path / "out", capsys)
    assert "posix.system" in err and "not on zerosafe's allowlist" in err
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in err
    assert not marker.exists()
    with pytest.raises(UnsafePickleError):
        convert_checkpoint(str(sample_ckpt), str(tmp_path / "out"))
    assert main(["inspect", str(sample_ckpt)]) == 2
    assert not marker.exists()


@pytest.mark.parametrize(
    ("name", "match"),
    [
        (
            "zero_pp_rank_0_mp_rank_01_model_states.pt",
            "tensor-parallel .*mp_rank_01.*not supported yet",
        ),
        ("layer_01-model_00-model_states.pt", "pipeline-parallel.*not supported yet"),
        ("expp_rank_0_mp_rank_00_optim_states.pt", "MoE trained without ZeRO .stage 0."),
        ("expert_3_mp_rank_00_model_states.pt", "expert file without a layer id"),
        ("layer_0_expert_1_mp_rank_01_model_states.pt", "expert tensor parallelism"),
    ],
)
def test_unsupported_layouts_are_named(
    sample_ckpt: Path, tmp_path: Path, name: str, match: str
) -> None:
    shutil.copy(_model(sample_ckpt, 0), sample_ckpt / TAG / name)
    with pytest.raises(UnsupportedCheckpointError, match=match) as e:
        convert_checkpoint(str(sample_ckpt), str(tmp_path / "out"))
    assert name in str(e.value)


@pytest.mark.parametrize(
    ("extra", "what"),
    [
        ("layer_00-model_states.pt", "pipeline-parallel layer files"),
        ("zero_pp_rank_0_mp_rank_01_model_states.pt", r"model-parallel rank files \(mp_rank_01\)"),
        (
            "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
            r"model-parallel rank files \(mp_rank_01\)",
        ),
    ],
)
def test_moe_with_pipeline_or_tensor_parallelism_is_refused(
    sample_ckpt: Path, tmp_path: Path, capsys, extra: str, what: str
) -> None:
    """Expert files beside pipeline layer files or mp_rank_01+ files: refused from the listing
    (before any file is read), naming an expert file and the model-parallel one."""
    expert = "layer_0_expert_0_mp_rank_00_model_states.pt"
    for name in (expert, "layer_0_expert_1_mp_rank_00_model_states.pt", extra):
        shutil.copy(_model(sample_ckpt, 0), sample_ckpt / TAG / name)
    match = f"MoE expert files .*beside {what}.*MoE combined with pipeline or tensor parallelism"
    with pytest.raises(UnsupportedCheckpointError, match=match) as e:
        convert_checkpoint(str(sample_ckpt), str(tmp_path / "out"))
    assert expert in str(e.value) and "and 1 more" in str(e.value) and extra in str(e.value)
    from zerosafe.formats.registry import quick_identities
    from zerosafe.io.storage import Storage

    with pytest.raises(UnsupportedCheckpointError, match=match):  # the job key's listing too
        quick_identities(Storage(), str(sample_ckpt), None)
    err = _convert_fails(sample_ckpt, tmp_path / "out2", capsys)
    assert "MoE combined with pipeline or tensor parallelism" in err and extra in err


def test_moe_layout_in_model_parallel_files_is_refused() -> None:
    """An MoE layout (AutoEP ZeRO-3 writes no expert files) read from a pipeline stage or from
    mp_rank_01+ files is refused too; plain mp_rank_00 files pass."""
    from types import SimpleNamespace

    from zerosafe.formats.deepspeed.rank_files import refuse_moe_in_model_parallel_files

    def files(*names: str) -> list:
        return [SimpleNamespace(url=f"/c/{TAG}/{n}") for n in names]

    plain = files("zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt")
    refuse_moe_in_model_parallel_files(plain, None, 1)
    match = "MoE combined with pipeline or tensor parallelism is not supported"
    with pytest.raises(UnsupportedCheckpointError, match=match + ".*") as e:
        refuse_moe_in_model_parallel_files(
            files(
                "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                "zero_pp_rank_0_mp_rank_01_optim_states.pt",
            ),
            None,
            1,
        )
    assert "zero_pp_rank_0_mp_rank_01_optim_states.pt" in str(e.value)
    with pytest.raises(UnsupportedCheckpointError, match="pipeline stage 1"):
        refuse_moe_in_model_parallel_files(plain, 1, 2)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        refuse_moe_in_model_parallel_files(plain, None, 2)  # replicated mp ranks


def test_not_a_checkpoint_folder(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    err = _convert_fails(tmp_path / "empty", tmp_path / "out", capsys)
    assert "not a checkpoint zerosafe reads: an empty folder" in err
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "zero_to_fp32.py").write_text("")  # DeepSpeed's: its message says more
    err = _convert_fails(tmp_path / "ds", tmp_path / "out", capsys)
    assert "no 'latest' file" in err
    err = _convert_fails(tmp_path / "nope", tmp_path / "out", capsys)
    assert "no such checkpoint folder" in err


def test_latest_names_a_missing_tag_and_unknown_tag(
    sample_ckpt: Path, tmp_path: Path, capsys
) -> None:
    err = _convert_fails(sample_ckpt, tmp_path / "out", capsys, "--tag", "global_step9")
    assert "tag 'global_step9' not found" in err and TAG in err
    (sample_ckpt / "latest").write_text("global_step7")
    err = _convert_fails(sample_ckpt, tmp_path / "out", capsys)
    assert "still saving it" in err


def test_output_policy_noop_refuse_overwrite(sample_ckpt: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["convert", "--via", "local", str(sample_ckpt), str(out)]) == 0
    capsys.readouterr()
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["convert", "--via", "local", str(sample_ckpt), str(out)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    code = main(["convert", "--via", "local", str(sample_ckpt), str(out), "--dtype", "bf16"])
    err = capsys.readouterr().err
    assert code == 2 and "already holds a complete conversion" in err and "--overwrite" in err
    with pytest.raises(OutputExistsError):
        convert_checkpoint(str(sample_ckpt), str(out), ConvertOptions(dtype="bf16"))
    assert (
        main(
            [
                "convert",
                "--via",
                "local",
                str(sample_ckpt),
                str(out),
                "--dtype",
                "bf16",
                "--overwrite",
            ]
        )
        == 0
    )
    from safetensors.torch import load_file

    assert load_file(str(out / "model.safetensors"))["embed.weight"].dtype == torch.bfloat16


def test_foreign_model_files_are_not_overwritten(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone else's weights")
    with pytest.raises(OutputExistsError, match="model files not written by this job"):
        convert_checkpoint(str(sample_ckpt), str(out))
    assert (out / "model.safetensors").read_bytes() == b"someone else's weights"


def test_layout_mismatch_is_named(sample_ckpt: Path, tmp_path: Path) -> None:
    # A model-states file from another model: param shapes no longer match the partitions.
    path = _model(sample_ckpt, 0)
    states = torch.load(path, weights_only=True)
    first = states["param_shapes"][0]
    name = next(iter(first))
    first[name] = torch.Size([first[name][0] + 5, *first[name][1:]])
    for rank in range(3):
        s = torch.load(_model(sample_ckpt, rank), weights_only=True)
        s["param_shapes"] = states["param_shapes"]
        torch.save(s, _model(sample_ckpt, rank))
    with pytest.raises(
        LayoutMismatchError, match=r"needs exactly .*another world size or another model"
    ):
        convert_checkpoint(str(sample_ckpt), str(tmp_path / "out"))


def test_cli_error_is_one_line_for_subprocess(sample_ckpt: Path, tmp_path: Path) -> None:
    _optim(sample_ckpt, 0).unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", "--via", "local", str(sample_ckpt), str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_check_lowp_stops_publishing_when_16bit_weights_disagree(tmp_path: Path) -> None:
    """A real DeepSpeed ZeRO-1 checkpoint whose saved bf16 copy of one weight was altered:
    the fp32 output is still what the masters say, but the cross-check names the tensor and
    nothing is published."""
    from tests.conftest import SHARED_FIXTURES
    from zerosafe.errors import VerificationError

    src = SHARED_FIXTURES / "z1-bf16-ws2-basic" / "checkpoint"
    if not src.exists():
        pytest.skip("shared fixtures not present")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    for f in ckpt.rglob("*"):
        f.chmod(0o644 if f.is_file() else 0o755)
    model = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    states = torch.load(model, weights_only=True)  # test-only surgery; no DeepSpeed classes here
    # past the few elements the plan's own sample compares (`save_identity`): only the full
    # cross-check sees it
    states["module"]["l1.weight"][-1, -1] += 1.0
    torch.save(states, model)
    out = tmp_path / "out"
    with pytest.raises(VerificationError, match=r"l1\.weight: lowp: cast to bfloat16 differs"):
        convert_checkpoint(str(ckpt), str(out), ConvertOptions(check_lowp=True))
    assert not (out / "zerosafe-complete.json").exists()
    convert_checkpoint(str(ckpt), str(tmp_path / "unchecked"))  # the masters alone convert fine


def test_optimizer_without_param_groups_is_not_taken_for_moe(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """MoE is detected from the optimizer's `moe` param groups among other signs; a checkpoint
    without MoE whose optimizer saved no readable `param_groups` still converts."""
    for rank in range(3):
        sd = torch.load(_optim(sample_ckpt, rank), weights_only=False)
        sd["optimizer_state_dict"]["optimizer_state_dict"].pop("param_groups")
        torch.save(sd, _optim(sample_ckpt, rank))
    summary = convert_checkpoint(str(sample_ckpt), str(tmp_path / "out"))
    assert summary.status == "converted"


def test_a_fifo_named_latest_is_refused_not_waited_on(sample_ckpt: Path, tmp_path: Path) -> None:
    """Issue 37 item 8: a FIFO named `latest` hung `convert` (and `verify --against`) forever."""
    (sample_ckpt / "latest").unlink()
    os.mkfifo(sample_ckpt / "latest")
    proc = zerosafe_child("convert", "--via", "local", sample_ckpt, tmp_path / "out", timeout_s=60)
    assert_refused_in_one_line(
        proc, f"{sample_ckpt}/latest: expected DeepSpeed's `latest`", "found a FIFO", "--tag"
    )
    assert not (tmp_path / "out" / "zerosafe-complete.json").exists()


def test_latest_linked_to_dev_zero_is_refused(sample_ckpt: Path, tmp_path: Path) -> None:
    """Issue 37 item 8: `latest` linked to /dev/zero read until memory ran out."""
    (sample_ckpt / "latest").unlink()
    os.symlink("/dev/zero", sample_ckpt / "latest")
    proc = zerosafe_child("convert", "--via", "local", sample_ckpt, tmp_path / "out", timeout_s=60)
    assert_refused_in_one_line(
        proc, "latest", "a regular file of at most 4096 bytes, found a device"
    )


def test_a_fifo_named_like_the_output_lease_is_refused_not_waited_on(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    """Issue 37 item 8: the lease is the first file a conversion reads in its output folder."""
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / ".zerosafe-lease.json")
    proc = zerosafe_child("convert", "--via", "local", sample_ckpt, out, timeout_s=60)
    assert_refused_in_one_line(proc, ".zerosafe-lease.json: expected a zerosafe lease", "FIFO")
