"""The command line: inspect, convert (engine driver), version, quiet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import SAMPLE_CKPT
from zerosafe import __version__
from zerosafe_app.cli import main


def test_version(capsys) -> None:
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.strip() == f"zerosafe {__version__}"


def test_inspect_reports_what_a_user_needs(capsys) -> None:
    assert (
        main(["inspect", str(SAMPLE_CKPT), "--max-shard-size", "20KB", "--memory", "256MiB"]) == 0
    )
    out = capsys.readouterr().out
    for text in (
        "ZeRO stage 3",
        "trained in bfloat16",
        "world size 3",
        "DeepSpeed 0.19.8",
        "tied: lm_head.weight -> embed.weight",
        "frozen: side.weight",
        "Adam moments are never read",
        "model-00001-of-",
        "Memory      about",
        "Tasks",
    ):
        assert text in out, text


def test_inspect_json(capsys) -> None:
    assert main(["inspect", str(SAMPLE_CKPT), "--json", "--dtype", "bf16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        report["zero_stage"] == 3
        and report["world_size"] == 3
        and report["train_dtype"] == "bfloat16"
    )
    assert report["params"]["tied"] == {"lm_head.weight": "embed.weight"}
    by = report["output"]["bytes_by_dtype"]
    assert by["bfloat16"] < by["float32"] and report["output"]["dtype"] == "bfloat16"
    reads = report["reads"]
    assert reads["total_bytes"] < report["files"]["total_bytes"] / 2
    assert report["memory"]["peak_bytes"] <= report["memory"]["budget_bytes"]


def test_convert_then_verify_from_a_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", "--via", "local", str(SAMPLE_CKPT), str(out), "--max-shard-size", "20KB"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "converted" in proc.stdout and "tied: lm_head.weight -> embed.weight" in proc.stdout
    assert (out / "model.safetensors.index.json").exists() and (
        out / "zerosafe-complete.json"
    ).exists()
    proc = subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "verify", str(out), "--against", str(SAMPLE_CKPT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK")


def test_quiet_prints_nothing_on_success(tmp_path: Path, capsys) -> None:
    assert main(["convert", "--via", "local", "-q", str(SAMPLE_CKPT), str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_convert_json_summary(tmp_path: Path, capsys) -> None:
    assert (
        main(
            [
                "convert",
                "--via",
                "local",
                "--json",
                "--mode",
                "direct",
                str(SAMPLE_CKPT),
                str(tmp_path / "o"),
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["status"] == "converted" and summary["mode"] == "direct"
    assert summary["aliases"] == {"lm_head.weight": "embed.weight"}


def test_the_help_texts_name_every_format_read() -> None:
    """The texts that list the formats are written out (the command's start-up imports no
    reader, `import zerosafe` none either); every reader of the registry must be named in
    each: the checkpoint's help, the command's description, the flow's docstring (its
    description in Prefect) and the engine's docstring (issue 38: verl was missing from
    three of them)."""
    import zerosafe
    from zerosafe.formats.registry import READERS
    from zerosafe_app.cli import CHECKPOINT_HELP, DESCRIPTION
    from zerosafe_app.flows.convert import convert

    texts = {
        "CHECKPOINT_HELP": CHECKPOINT_HELP,
        "DESCRIPTION": DESCRIPTION,
        "the flow's docstring": " ".join((convert.description or "").split()),
        "zerosafe's docstring": " ".join((zerosafe.__doc__ or "").split()),
    }
    for reader in READERS:
        for where, text in texts.items():
            assert reader.title in text, (reader.title, where)
