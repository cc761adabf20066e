"""torch_checkpointing saves, both layouts (`model_R.pt`, and `model_R.safetensors` with
`metadata.pkl`, written by the library's own `CheckpointManager`, see conftest.py), through
what the DCP reader survives (issue 39): SIGKILL midway and the same command again, S3 into
S3, and `verify --against` failing on a flipped byte (`tests/formats/robust.py` has the
checks)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.formats.robust import (
    kill_midway_then_resume,
    s3_to_s3_equals_local,
    verify_then_flip_a_byte,
)
from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
from tests.io.s3.support import MotoServer
from zerosafe_app.cli import main

pytestmark = pytest.mark.slow

ARGS = ("--dtype", "bf16", "--max-shard-size", "100B")
"""bf16 in eleven shards, one per tensor: every merge reassembles the ranks' pieces (the
embedding's uneven ones among them) and casts, and a kill can land between shards."""


@pytest.fixture(scope="module", params=["pt", "st"])
def save(request: pytest.FixtureRequest, tc_save: Callable[[str], Path]) -> Path:
    """The `step_1/` folder of each layout: `pt` (`model_R.pt`, DTensor local shards) and
    `st` (`model_R.safetensors` placed by `metadata.pkl`); the other items' files beside."""
    return tc_save(request.param)


@pytest.fixture(scope="module")
def reference(save: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted local conversion of the save with `ARGS`."""
    out = tmp_path_factory.mktemp(f"tc-{save.parent.name}-reference") / "out"
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
