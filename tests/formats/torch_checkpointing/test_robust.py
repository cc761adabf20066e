"""torch_checkpointing saves, both layouts (`model_R.pt`, and `model_R.safetensors` with
`metadata.pkl`, written by the library's own `CheckpointManager`, see conftest.py), through
what the DCP reader survives (issue 39): SIGKILL midway and the same command again, S3 into
S3, and `verify --against` failing on a flipped byte (`tests/formats/robust.py` has the
checks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.formats.robust import RobustChecks
from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["pt", "st"])
def save(request: pytest.FixtureRequest, tc_save: Callable[[str], Path]) -> Path:
    """The `step_1/` folder of each layout: `pt` (`model_R.pt`, DTensor local shards) and
    `st` (`model_R.safetensors` placed by `metadata.pkl`); the other items' files beside."""
    return tc_save(request.param)


class TestRobust(RobustChecks):
    ARGS = ("--dtype", "bf16", "--max-shard-size", "100B")
    """bf16 in eleven shards, one per tensor: every merge reassembles the ranks' pieces (the
    embedding's uneven ones among them) and casts, and a kill can land between shards."""
