"""A ByteCheckpoint step folder (`global_step_N/`, as `bytecheckpoint.save` writes it) through
what the DCP reader survives (issue 39): SIGKILL midway and the same command again, S3 into
S3, and `verify --against` failing on a flipped byte (`tests/formats/robust.py` has the
checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.formats.robust import RobustChecks
from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def save(bytecheckpoint_root: Path) -> Path:
    """The step folder a user passes: `model/`, `optimizer/` and `extra_state/` in it."""
    return bytecheckpoint_root / "ckpt" / "global_step_3"


class TestRobust(RobustChecks):
    ARGS = ("--dtype", "bf16", "--max-shard-size", "100B")
    """bf16 in several shards: every merge casts, and a kill can land between shards."""
