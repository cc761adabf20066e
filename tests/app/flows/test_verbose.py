"""`convert -v` prints zerosafe's own lines (one per extract, merge and verify task), not
Prefect's anonymous 'Finished in state Completed()' lines or links; the server's URL only in
the summary's `ran:` line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.app.flows.conftest import run_cli
from tests.conftest import SAMPLE_CKPT


@pytest.mark.slow
def test_verbose_is_zerosafes_lines_not_prefect_noise(
    prefect_env: dict[str, str], tmp_path: Path
) -> None:
    proc = run_cli(
        prefect_env, "convert", "-v", "--mode", "staged", str(SAMPLE_CKPT), str(tmp_path / "o")
    )
    err = proc.stderr
    for line in ("extract rank 0 part 0:", "merge shard 1/1:", "verify model.safetensors:"):
        assert f"zerosafe: INFO: {line}" in err, err
    for noise in ("Finished in state", "View at"):
        assert noise not in err + proc.stdout, err
    # The server's URL appears once, where the summary says where the run went.
    urls = [line for line in (err + proc.stdout).splitlines() if "http://127.0.0.1" in line]
    assert [line.split(":", 1)[0].strip() for line in urls] == ["ran"], urls
