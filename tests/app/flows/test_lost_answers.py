"""The flow when the Prefect server's answer to a run's final state change is lost (a loaded
server, a dropped connection): the server records the state, the client sends the change again
and is told it was already made. The conversion's result must still come back, and its
one-line error too (`lossy_proxy`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.flows.conftest import convert_json, run_cli
from tests.app.flows.lossy_proxy import LossyProxy, final_state_changes
from tests.helpers import load_output
from tests.stages.test_trust import _holding_output

pytestmark = pytest.mark.slow


@pytest.fixture
def lossy(prefect_env: dict[str, str]) -> Iterator[tuple[dict[str, str], LossyProxy]]:
    """An environment whose Prefect API is the test server behind a `LossyProxy` that loses
    the answer to each flow run's first final state change; and that proxy."""
    proxy = LossyProxy(prefect_env["PREFECT_API_URL"], final_state_changes())
    with proxy.running():
        yield {**prefect_env, "PREFECT_API_URL": proxy.url}, proxy


def test_a_lost_answer_to_the_final_state_keeps_the_summary(
    lossy: tuple[dict[str, str], LossyProxy], sample_ckpt: Path, tmp_path: Path
) -> None:
    env, proxy = lossy
    out = tmp_path / "out"
    summary = convert_json(env, str(sample_ckpt), str(out))
    assert proxy.lost == 2  # the answers to `convert-job`'s Completed, then `convert`'s
    assert summary["status"] == "converted"
    assert summary["num_tensors"] == len(load_output(out)[0])


def test_a_lost_answer_to_a_failed_state_keeps_the_one_line_error(
    lossy: tuple[dict[str, str], LossyProxy], sample_ckpt: Path, tmp_path: Path
) -> None:
    env, proxy = lossy
    out = tmp_path / "out"
    with _holding_output(out):
        proc = run_cli(env, "convert", str(sample_ckpt), str(out), check=False)
    assert proxy.lost == 2  # the answers to `convert-job`'s Failed, then `convert`'s
    assert proc.returncode == 2, proc.stderr
    assert "another conversion into this output folder is running" in proc.stderr
    assert "Traceback" not in proc.stderr
