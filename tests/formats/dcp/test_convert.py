"""DCP checkpoints through the `zerosafe` command (`convert`, `inspect`, `verify`), compared with
torch's own `dcp_to_torch_save`, bit-exact after the dtype policy (an exact cast from the saved
dtype). `main([..., "--via", "local"])` runs the engine's driver in-process; the flow itself is
tested in test_flow.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import SAMPLE_CKPT
from tests.formats.dcp.helpers import same_bits
from zerosafe.config import ConvertOptions
from zerosafe_app.cli import main

Checkpoint = Callable[[str], Path]
Oracle = Callable[[str], dict[str, object]]
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def convert(capsys: pytest.CaptureFixture[str], src: Path, out: Path, *args: str) -> dict[str, Any]:
    code, stdout, err = run(
        capsys, "convert", str(src), str(out), "--via", "local", "--json", *args
    )
    assert code == 0, err
    return dict(json.loads(stdout))


def load_output(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def model_oracle(oracle: dict[str, object], prefix: str = "model.") -> dict[str, torch.Tensor]:
    return {
        k.removeprefix(prefix): v
        for k, v in oracle.items()
        if k.startswith(prefix) and isinstance(v, torch.Tensor)
    }


def assert_matches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], dtype: str) -> None:
    assert set(got) == set(want)
    for key, ref in want.items():
        cast = ref.to(TORCH_DTYPES[dtype]) if ref.is_floating_point() else ref
        assert same_bits(got[key], cast), key


@pytest.mark.parametrize(
    ("name", "dtype", "mode"),
    [
        ("dtensor", "fp32", "direct"),
        ("dtensor", "bf16", "staged"),
        ("fsdp2", "fp32", "staged"),
        ("fsdp2", "bf16", "direct"),
    ],
)
def test_convert_matches_dcp_to_torch_save(
    name: str,
    dtype: str,
    mode: str,
    dcp_checkpoint: Checkpoint,
    dcp_oracle: Oracle,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, out = dcp_checkpoint(name), tmp_path / "out"
    summary = convert(capsys, src, out, "--dtype", dtype, "--mode", mode, "--max-shard-size", "3KB")
    assert summary["status"] == "converted" and (out / "zerosafe-complete.json").exists()
    assert len(summary["files"]) > 1 or (name, dtype) == ("fsdp2", "bf16")
    integrity = summary["integrity"]
    assert integrity["records_failed"] == [] and integrity["records_skipped"] == []
    assert integrity["records_checked"] > 0
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert_matches(load_output(out), model_oracle(dcp_oracle(name)), dtype)
    assert manifest["source"]["format"] == "dcp"
    assert manifest["source"]["select"] == ["model"]
    assert manifest["source"]["strip_prefix"] == "model"
    assert ("step" in manifest["source"]["non_tensor_entries"]) == (name == "dtensor")
    again = convert(capsys, src, out, "--dtype", dtype, "--mode", mode, "--max-shard-size", "3KB")
    assert again["status"] == "already-complete"


def test_every_chunk_crc_is_checked(
    dcp_checkpoint: Checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zerosafe.formats.dcp.reader import read_dcp_layout
    from zerosafe.io.storage import Storage

    src = dcp_checkpoint("dtensor")
    layout = read_dcp_layout(str(src), Storage())
    with_crc = {(s.file, s.record_offset) for s in layout.slots if s.record_crc32}
    assert len(with_crc) == len(layout.slots) > 20
    # Every chunk is its own torch.save archive, so chunks share record names: the CRC
    # ledger keys records by file and offset, and checks each chunk's CRC on its own.
    assert len({(s.file, s.record) for s in layout.slots}) < len(layout.slots)
    summary = convert(capsys, src, tmp_path / "out", "--mode", "direct")
    assert summary["integrity"]["records_checked"] == len(with_crc)


def test_select_optimizer_state(
    dcp_checkpoint: Checkpoint,
    dcp_oracle: Oracle,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, out = dcp_checkpoint("fsdp2"), tmp_path / "out"
    summary = convert(capsys, src, out, "--select", "optim.state", "--strip-prefix", "optim.state")
    assert_matches(load_output(out), model_oracle(dcp_oracle("fsdp2"), "optim.state."), "fp32")
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert manifest["options"]["select"] == ["optim.state"]
    assert manifest["options"]["strip_prefix"] == "optim.state"
    default = convert(capsys, src, tmp_path / "default")
    assert default["job_key"] != summary["job_key"]
    code, stdout, _ = run(capsys, "verify", str(out), "--against", str(src), "--json")
    assert code == 0 and json.loads(stdout)["against"]["expected_tensors"] == len(
        manifest["tensors"]
    )


def test_verify_and_verify_against(
    dcp_checkpoint: Checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = dcp_checkpoint("dtensor"), tmp_path / "out"
    convert(capsys, src, out, "--dtype", "bf16")
    code, stdout, _ = run(capsys, "verify", str(out))
    assert code == 0 and stdout.startswith("OK")
    code, stdout, _ = run(capsys, "verify", str(out), "--against", str(src), "--json")
    report = json.loads(stdout)
    assert code == 0, report["failures"]
    against = report["against"]
    assert against["source_identity"] == "same contents"
    assert against["values_sampled"] > 20 and against["tag"] == "dtensor"
    # Another checkpoint: other tensors and other contents.
    code, stdout, _ = run(
        capsys, "verify", str(out), "--against", str(dcp_checkpoint("fsdp2")), "--json"
    )
    report = json.loads(stdout)
    assert code == 1
    assert {f["check"] for f in report["failures"]} >= {"coverage", "source"}


def test_verify_against_finds_a_changed_value(
    dcp_checkpoint: Checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = dcp_checkpoint("flat"), tmp_path / "out"
    convert(capsys, src, out)
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header] ^= 0x40  # the first byte of the first tensor
    path.write_bytes(bytes(data))
    code, stdout, _ = run(capsys, "verify", str(out), "--against", str(src), "--json")
    checks = {f["check"] for f in json.loads(stdout)["failures"]}
    assert code == 1 and "values" in checks


def test_inspect_says_what_it_found(
    dcp_checkpoint: Checkpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text, _ = run(capsys, "inspect", str(dcp_checkpoint("dtensor")))
    assert code == 0
    lines = text.splitlines()
    assert "(PyTorch DCP, metadata version" in lines[0]
    assert "tensors selected (under 'model', 'model.' stripped)" in lines[1]
    assert "never read (top-level keys ['optim'])" in lines[1]
    assert ".distcp file(s)" in text and "torch_save" in text
    assert "4 chunks on dim 0" in text and "4 chunks on dim 1" in text
    assert "2x2 grid on dims 0,1" in text and "inferred from the chunks: (2, 2), (4,)" in text
    assert "non-tensor entries (listed in the manifest, not converted): " in text and "step" in text
    assert "bfloat16 x" in text and "float32 x" in text
    assert "Reads" in text and "chunks of the selected tensors" in text
    code, text, _ = run(capsys, "inspect", "--json", str(dcp_checkpoint("flat")))
    report = json.loads(text)
    assert report["format"] == "dcp" and report["tensors_selected"] == 3
    assert report["select"] == [""] and report["strip_prefix"] is None


def test_refusals_through_the_command(
    dcp_checkpoint: Checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(
        capsys,
        "convert",
        str(SAMPLE_CKPT),
        str(tmp_path / "o"),
        "--select",
        "model",
        "--via",
        "local",
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--select applies only to PyTorch DCP checkpoints" in err and "DeepSpeed ZeRO" in err
    code, _, err = run(capsys, "inspect", str(SAMPLE_CKPT), "--strip-prefix", "model")
    assert code == 2 and "--strip-prefix applies only to PyTorch DCP" in err
    src = dcp_checkpoint("flat")
    code, _, err = run(capsys, "inspect", str(src), "--tag", "global_step1")
    assert code == 2 and "PyTorch DCP checkpoint, which is one save" in err
    code, _, err = run(capsys, "inspect", str(src), "--select", "model")
    assert code == 2 and "no tensor matches `select` ['model']" in err


def test_selection_options_leave_other_job_keys_alone() -> None:
    # DeepSpeed jobs (and DCP jobs with the default selection) keep their job keys.
    assert "select" not in ConvertOptions().identity()
    assert "strip_prefix" not in ConvertOptions().identity()
    assert ConvertOptions(select=["a"]).identity()["select"] == ["a"]  # type: ignore[arg-type]
    assert ConvertOptions(strip_prefix="").identity()["strip_prefix"] == ""


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--select", "model", "--strip-prefix", "."), "--strip-prefix"),
        (("--strip-prefix", ".."), "--strip-prefix"),
        (("--select", "."), "--select"),
        (("--select", ""), "--select"),
        (("--select", "model", "--select", "..."), "--select"),
    ],
)
def test_a_prefix_empty_after_removing_dots_is_refused(
    args: tuple[str, ...],
    flag: str,
    dcp_checkpoint: Checkpoint,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 24 item 1: `--select model --strip-prefix .` wrote 'odel.w' (the first character
    of every name cut), exit 0, and verify said OK; `--select .` selected every tensor."""
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "convert", str(dcp_checkpoint("fsdp2")), str(out), "--via", "local", *args
    )
    assert code == 2 and err.count("\n") == 1, err
    assert f"`{flag}`" in err and "empty once its dots are removed" in err
    assert not list(out.glob("*.safetensors"))


def test_dots_around_a_prefix_are_only_spelling(
    dcp_checkpoint: Checkpoint,
    dcp_oracle: Oracle,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = dcp_checkpoint("fsdp2")
    dotted = convert(capsys, src, tmp_path / "a", "--select", "model.", "--strip-prefix", "model.")
    assert_matches(load_output(tmp_path / "a"), model_oracle(dcp_oracle("fsdp2")), "fp32")
    plain = ConvertOptions(select=("model",), strip_prefix="model")
    assert ConvertOptions(select=("model.",), strip_prefix="model.") == plain
    assert dotted["job_key"] == convert(capsys, src, tmp_path / "b", "--select", "model",
                                        "--strip-prefix", "model")["job_key"]  # fmt: skip
