"""Rank files of torch's `HuggingFaceStorageWriter` through what the DCP reader survives
(issue 39): SIGKILL midway and the same command again, S3 into S3, and `verify --against`
failing on a flipped byte (`tests/formats/robust.py` has the checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.formats.robust import RobustChecks
from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def save(hf_storage_root: Path) -> Path:
    """The rank files alone (`save_distributed=True`, no consolidation)."""
    return hf_storage_root / "plain"


class TestRobust(RobustChecks):
    ARGS = ("--dtype", "bf16", "--max-shard-size", "100B")
    """bf16 in seven shards: every merge reassembles and casts, and a kill can land between
    shards."""
