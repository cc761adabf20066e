"""A pending shard damaged in place between a killed run and its rerun (issue 37, the weights
twin of item 5), on both executors: the in-process driver and the flow.

A run SIGKILLed as it starts to publish leaves every shard verified and pending, with its
merge and verify recorded (unit records, or the flow's cached task results). A block of one
pending shard is then zeroed at the same size and mtime, which neither size nor version sees.
Before the fix the rerun kept the merge, reused the earlier run's verify, published the
damaged shard as converted and exited 0. Now every run verifies each shard again: the rerun
fails on that shard, publishes nothing and discards its work; the next run converts, byte
for byte a clean run's output, and `zerosafe verify` passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.app.flows.conftest import convert_json, run_cli
from tests.conftest import SAMPLE_CKPT
from tests.helpers import kill_before_publish, zero_a_block_in_place

ARGS = ("--max-shard-size", "20KB", "--dtype", "bf16", "--mode", "staged")
"""Several shards, every stage runs."""


def _model_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.glob("model*")}


@pytest.mark.parametrize(
    "via", ["local", pytest.param("prefect", marks=pytest.mark.slow)]
)  # fmt: skip
def test_a_pending_shard_damaged_after_a_kill_is_never_published(
    via: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    env = request.getfixturevalue(f"{via}_env")
    args = (*ARGS, "--via", via)
    clean = convert_json(env, str(SAMPLE_CKPT), str(tmp_path / "clean"), *args)
    shards = len(clean["files"])
    assert shards > 1
    out = tmp_path / "out"
    kill_before_publish(env, str(SAMPLE_CKPT), str(out), *args)
    assert not (out / "zerosafe-complete.json").exists()
    (work,) = (out / ".zerosafe-work").iterdir()
    pending = sorted((work / "pending").glob("model-*.safetensors"))
    assert len(pending) == shards, "the kill must come after every shard was verified"
    damaged = pending[1]
    zero_a_block_in_place(damaged)

    proc = run_cli(env, "convert", str(SAMPLE_CKPT), str(out), *args, check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "checksum" in proc.stderr and damaged.name in proc.stderr, proc.stderr[-2000:]
    assert not (out / "zerosafe-complete.json").exists()
    assert not (out / damaged.name).exists(), "the damaged shard was published"

    again = convert_json(env, str(SAMPLE_CKPT), str(out), *args)
    assert again["status"] == "converted"
    assert _model_files(out) == _model_files(tmp_path / "clean")
    assert not (out / ".zerosafe-work").exists()
    verified = run_cli(env, "verify", str(out), check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.parametrize(
    "via", ["local", pytest.param("prefect", marks=pytest.mark.slow)]
)  # fmt: skip
def test_a_rerun_keeps_the_merges_and_verifies_every_shard_again(
    via: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Undamaged, the same rerun keeps every extract and merge, and still re-reads every
    shard it publishes (the bytes counted in its stats)."""
    env = request.getfixturevalue(f"{via}_env")
    args = (*ARGS, "--via", via)
    out = tmp_path / "out"
    kill_before_publish(env, str(SAMPLE_CKPT), str(out), *args)
    (work,) = (out / ".zerosafe-work").iterdir()
    written = sum(p.stat().st_size for p in (work / "pending").glob("model-*.safetensors"))
    summary = convert_json(env, str(SAMPLE_CKPT), str(out), *args)
    shards = len(summary["files"])
    assert summary["status"] == "converted"
    assert summary["tasks_executed"] == {"extract": 0, "merge": 0, "verify": shards}
    stats = json.loads((out / "zerosafe-manifest.json").read_text())["stats"]
    assert stats["bytes_read"] >= written  # the shards it verified
    verified = run_cli(env, "verify", str(out), check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr
