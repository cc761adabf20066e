"""Issue 16 through the flow (`zerosafe convert`, embedded Prefect): cached task results must
never carry a failed check, a path's spelling or a stale no-op past a run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.app.flows.conftest import convert_json, run_cli
from tests.helpers import load_output, same_bytes
from tests.stages.test_trust import _flip_fp32_bit, _holding_output, _optim

pytestmark = pytest.mark.slow


def test_paths_repairs_and_no_ops_through_the_flow(
    prefect_env: dict[str, str], sample_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    env = {**prefect_env}
    first = run_cli(
        env, "convert", "--json", "ckpt", "out", "--max-shard-size", "12KB", cwd=tmp_path
    )
    assert '"status": "converted"' in first.stdout
    before = {k: v.clone() for k, v in load_output(out)[0].items()}
    shards = sorted(out.glob("model-*.safetensors"))
    shards[0].unlink()
    # another spelling of the same job, from another directory: a repair of the lost shard
    again = convert_json(env, f"{sample_ckpt}/", f"file://{out}", "--max-shard-size", "12KB")
    assert again["status"] == "converted"
    assert again["tasks_executed"]["merge"] == len(shards)  # each merge task ran...
    assert again["source_bytes_read"] < first_source_bytes(first.stdout)  # ...one re-read
    after = load_output(out)[0]
    assert all(same_bytes(before[k], after[k]) for k in before)
    third = convert_json(env, str(sample_ckpt), str(out), "--max-shard-size", "12KB")
    assert third["status"] == "already-complete"


def first_source_bytes(stdout: str) -> int:
    import json

    return int(json.loads(stdout)["source_bytes_read"])


def test_a_failed_crc_is_not_cached_and_a_restored_file_converts(
    prefect_env: dict[str, str], sample_ckpt: Path, tmp_path: Path
) -> None:
    good = tmp_path / "good.pt"
    shutil.copy2(_optim(sample_ckpt, 1), good)
    _flip_fp32_bit(_optim(sample_ckpt, 1))
    out = tmp_path / "out"
    failed = run_cli(prefect_env, "convert", str(sample_ckpt), str(out), check=False)
    assert failed.returncode == 2 and "CRC32" in failed.stderr, failed.stderr
    assert not list(out.glob("model*"))
    shutil.copy2(good, _optim(sample_ckpt, 1))  # `cp -p`: same size and mtime as the bad copy
    assert os.stat(good).st_mtime_ns == _optim(sample_ckpt, 1).stat().st_mtime_ns
    assert convert_json(prefect_env, str(sample_ckpt), str(out))["status"] == "converted"


def test_a_held_output_is_refused_through_the_flow(
    prefect_env: dict[str, str], sample_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with _holding_output(out):
        proc = run_cli(
            prefect_env, "convert", str(sample_ckpt), str(out), "--dtype", "bf16", check=False
        )
    assert proc.returncode == 2, proc.stderr
    assert "another conversion into this output folder is running" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(out.glob("model*"))
