"""DCP through the real command and its Prefect flow (`python -m zerosafe_app.cli convert` in a
subprocess): bit-exact against `dcp_to_torch_save`, a no-op second run, SIGKILL in the middle
of the merges and resume, and a conversion from a real S3 server (moto, loopback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.forge import transformer_shapes
from bench.forge_dcp import forge_dcp_checkpoint
from tests.app.flows.conftest import convert_json, journal, results_persisted
from tests.conftest import REPO
from tests.formats.dcp.test_convert import assert_matches, load_output, model_oracle
from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
from tests.io.s3.support import MotoServer, assert_same_output, upload_folder
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint

pytestmark = pytest.mark.slow

Checkpoint = Callable[[str], Path]
Oracle = Callable[[str], dict[str, object]]


def test_flow_converts_and_then_has_nothing_to_do(
    prefect_env: dict[str, str],
    dcp_checkpoint: Checkpoint,
    dcp_oracle: Oracle,
    tmp_path: Path,
) -> None:
    src, out = dcp_checkpoint("dtensor"), tmp_path / "out"
    args = (str(src), str(out), "--dtype", "bf16", "--max-shard-size", "4KB")
    summary = convert_json(prefect_env, *args)
    assert summary["status"] == "converted", summary
    assert summary["integrity"]["records_failed"] == []
    assert_matches(load_output(out), model_oracle(dcp_oracle("dtensor")), "bf16")
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert (
        manifest["source"]["format"] == "dcp" and "step" in manifest["source"]["non_tensor_entries"]
    )
    assert convert_json(prefect_env, *args)["status"] == "already-complete"


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 30 M fp32 params in FSDP2's layout over 4 ranks (120 MB of model chunks)."""
    dest = tmp_path_factory.mktemp("dcp-forged") / "step-100"
    info = forge_dcp_checkpoint(dest, transformer_shapes("30M"), world_size=4, optimizer=False)
    assert info.model_bytes > 100e6
    return dest


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_sigkill_during_merges_then_resume(
    prefect_env: dict[str, str], forged: Path, tmp_path: Path
) -> None:
    reference = tmp_path / "reference"
    convert_checkpoint(
        str(forged), str(reference),
        ConvertOptions(dtype="bf16", max_shard_size=2 * 10**6, direct=True),
    )  # fmt: skip
    out = tmp_path / "out"
    args = (str(forged), str(out), "--dtype", "bf16", "--max-shard-size", "2MB", "--parallel", "1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", "--json", *args],
        env=prefect_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    work_root = out / ".zerosafe-work"

    def merges_done() -> int:
        works = list(work_root.iterdir()) if work_root.exists() else []
        if not works or not (works[0] / "journal").exists():
            return 0
        return sum(1 for e in journal(works[0]) if e["stage"] == "merge")

    def results_settled() -> bool:
        (work,) = work_root.iterdir()
        return merges_done() >= 2 and results_persisted(work)

    try:
        _wait_for(lambda: merges_done() >= 2, 600, "two merges to finish")
        _wait_for(results_settled, 60, "results to be persisted")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    (work,) = work_root.iterdir()
    before = {(e["stage"], e["index"]) for e in journal(work)}
    total = len(list(reference.glob("model-*")))
    assert not (out / "zerosafe-complete.json").exists()
    assert 2 <= sum(1 for s, _ in before if s == "merge") < total, "the kill came too late"
    t0 = time.time()
    summary = convert_json(prefect_env, *args, "--keep-work")
    rerun = {(e["stage"], e["index"]) for e in journal(work) if e["time"] >= t0}
    assert summary["status"] == "converted" and ("publish", 0) in rerun
    # every shard is verified again (a verify result never outlives its run); nothing else
    again = {(s, i) for s, i in rerun & before if s != "verify"}
    assert not again, f"re-executed tasks that had completed: {sorted(again)}"
    assert {i for s, i in before | rerun if s == "merge"} == set(range(total))
    assert_same_output(out, reference)


def test_convert_from_s3(
    moto: MotoServer,  # noqa: F811 - fixture
    bucket: str,  # noqa: F811 - fixture
    dcp_checkpoint: Checkpoint,
    tmp_path: Path,
) -> None:
    from zerosafe.io.storage import Storage

    local = dcp_checkpoint("fsdp2")
    url = upload_folder(moto.url, local, bucket, "dcp/fsdp2")
    reference = tmp_path / "reference"
    convert_checkpoint(str(local), str(reference), ConvertOptions(dtype="bf16", direct=True))
    out = tmp_path / "out"
    storage = Storage({"endpoint_url": moto.url})
    summary = convert_checkpoint(url, str(out), ConvertOptions(dtype="bf16"), storage=storage)
    assert summary.status == "converted" and summary.integrity is not None
    assert summary.integrity.records_failed == ()
    for name in ("model.safetensors",):
        assert (out / name).read_bytes() == (reference / name).read_bytes()
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    want = json.loads((reference / "zerosafe-manifest.json").read_text())
    assert manifest["tensors"] == want["tensors"]
    assert manifest["source"]["content_sha256"] == want["source"]["content_sha256"]
    # Optimizer chunks are never requested: what was read is the model's chunks and headers.
    from zerosafe.formats.registry import read_source

    layout = read_source(Storage(), str(local), tag=None, options=ConvertOptions())
    needed = sum(s.nbytes for s in layout.slots) + layout.metadata_bytes
    assert summary.stats.source_bytes_read <= 1.1 * needed
