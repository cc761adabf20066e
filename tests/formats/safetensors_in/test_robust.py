"""A `save_pretrained` folder through what the DCP reader survives (issue 39): SIGKILL midway
and the same command again, S3 into S3, `verify --against` failing on a flipped byte, and the
flow `convert` on a Prefect server (`tests/formats/robust.py` has the checks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.app.flows.conftest import convert_json
from tests.formats.robust import RobustChecks
from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
from tests.io.s3.support import assert_same_output

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def save(hf_folder: Callable[[str], Path]) -> Path:
    """`save_pretrained`'s sharded folder: seven files and `model.safetensors.index.json`."""
    return hf_folder("sharded")


class TestRobust(RobustChecks):
    ARGS = ("--dtype", "bf16", "--max-shard-size", "2KB")
    """bf16 in twelve shards: every merge casts, and a kill can land between shards."""

    def test_flow_on_a_prefect_server(
        self, save: Path, reference: Path, prefect_env: dict[str, str], tmp_path: Path
    ) -> None:
        """The flow `convert` (the cheapest of the new readers' saves), equal to the command's
        own run, byte for byte."""
        out = tmp_path / "out"
        summary = convert_json(prefect_env, str(save), str(out), "--via", "prefect", *self.ARGS)
        assert summary["status"] == "converted" and summary["via"] == "prefect", summary
        assert summary["integrity"]["records_failed"] == []
        assert_same_output(out, reference)
