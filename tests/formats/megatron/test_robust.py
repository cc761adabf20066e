"""A megatron-core `torch_dist` save (the committed `tp2` fixture) through what the DCP reader
survives (issue 39): SIGKILL midway and the same command again, S3 into S3, `verify --against`
failing on a flipped byte, and the flow `convert` on a Prefect server
(`tests/formats/robust.py` has the checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.app.flows.conftest import convert_json
from tests.formats.megatron.conftest import save_path
from tests.formats.robust import RobustChecks
from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
from tests.io.s3.support import assert_same_output

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def save() -> Path:
    """The `--save` folder of the tensor parallel 2 save (`latest_checkpointed_iteration.txt`
    and `iter_0000003/`): every weight is two ranks' pieces, stacked per layer."""
    return save_path("tp2")


class TestRobust(RobustChecks):
    ARGS = ("--dtype", "bf16", "--max-shard-size", "6KB")
    """bf16 in ten shards: every merge unstacks, splits and joins the two ranks' pieces and
    casts, and a kill can land between shards."""

    def test_flow_on_a_prefect_server(
        self, save: Path, reference: Path, prefect_env: dict[str, str], tmp_path: Path
    ) -> None:
        """The flow `convert` on the Megatron save, equal to the command's own run, byte for
        byte (the generated `config.json` included)."""
        out = tmp_path / "out"
        summary = convert_json(prefect_env, str(save), str(out), "--via", "prefect", *self.ARGS)
        assert summary["status"] == "converted" and summary["via"] == "prefect", summary
        assert summary["integrity"]["records_failed"] == []
        assert (out / "config.json").read_bytes() == (reference / "config.json").read_bytes()
        assert_same_output(out, reference)
