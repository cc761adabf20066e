"""A `save_pretrained` folder through what the DCP reader survives (issue 39): SIGKILL midway
and the same command again, S3 into S3, `verify --against` failing on a flipped byte, and the
flow `convert` on a Prefect server (`tests/formats/robust.py` has the checks)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.app.flows.conftest import convert_json
from tests.formats.robust import (
    kill_midway_then_resume,
    s3_to_s3_equals_local,
    verify_then_flip_a_byte,
)
from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
from tests.io.s3.support import MotoServer, assert_same_output
from zerosafe_app.cli import main

pytestmark = pytest.mark.slow

ARGS = ("--dtype", "bf16", "--max-shard-size", "2KB")
"""bf16 in twelve shards: every merge casts, and a kill can land between shards."""


@pytest.fixture(scope="module")
def save(hf_folder: Callable[[str], Path]) -> Path:
    """`save_pretrained`'s sharded folder: seven files and `model.safetensors.index.json`."""
    return hf_folder("sharded")


@pytest.fixture(scope="module")
def reference(save: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted local conversion of the save with `ARGS`."""
    out = tmp_path_factory.mktemp("hf-reference") / "out"
    assert main(["convert", str(save), str(out), "--via", "local", "-q", *ARGS]) == 0
    return out


def test_sigkill_midway_then_resume(
    save: Path, reference: Path, local_env: dict[str, str], tmp_path: Path
) -> None:
    kill_midway_then_resume(local_env, save, tmp_path / "out", reference, *ARGS)


def test_s3_to_s3(
    save: Path,
    reference: Path,
    moto: MotoServer,  # noqa: F811 - fixture
    bucket: str,  # noqa: F811 - fixture
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    s3_to_s3_equals_local(capsys, moto, bucket, save, reference, tmp_path, *ARGS)


def test_verify_against_then_a_flipped_byte(
    save: Path, reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = Path(shutil.copytree(reference, tmp_path / "out"))
    verify_then_flip_a_byte(capsys, out, save)


def test_flow_on_a_prefect_server(
    save: Path, reference: Path, prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """The flow `convert` (the cheapest of the new readers' saves), equal to the command's
    own run, byte for byte."""
    out = tmp_path / "out"
    summary = convert_json(prefect_env, str(save), str(out), "--via", "prefect", *ARGS)
    assert summary["status"] == "converted" and summary["via"] == "prefect", summary
    assert summary["integrity"]["records_failed"] == []
    assert_same_output(out, reference)
