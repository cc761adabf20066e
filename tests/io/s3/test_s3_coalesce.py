"""Merges from a real S3 server make ranged requests in proportion to their bytes, not to their
fragments (`zerosafe.io.coalesce`), within the task's budget, with the local output's bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import zerosafe.pipeline as pipeline
from tests.io.s3.faultproxy import FaultProxy
from tests.io.s3.support import MotoServer, download_folder, upload_folder
from tests.io.test_coalesce import MergeTrace, merge_request_bound
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.io.storage import Storage


def test_merge_requests_follow_bytes_not_fragments(
    moto: MotoServer,
    bucket: str,
    proxy: FaultProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench.forge import forge_checkpoint, transformer_shapes

    ckpt = tmp_path / "ckpt"
    forge_checkpoint(
        ckpt, shapes=transformer_shapes(3_000_000), stage=3, world_size=32, dtype="bf16"
    )
    local = tmp_path / "local"
    convert_checkpoint(str(ckpt), str(local), ConvertOptions())
    src = upload_folder(moto.url, ckpt, bucket, "ckpt")
    options = ConvertOptions(memory=48 * 2**20)  # the smallest budget: 2 MiB chunks
    trace = MergeTrace(monkeypatch)
    wire: list[int] = []
    traced = pipeline.merge_shard

    def on_wire(*args: Any, **kwargs: Any) -> Any:
        before = len(proxy.requests("GET"))
        result = traced(*args, **kwargs)
        wire.append(len(proxy.requests("GET")) - before)
        return result

    monkeypatch.setattr(pipeline, "merge_shard", on_wire)
    summary = convert_checkpoint(
        src, f"s3://{bucket}/out", options, storage=Storage({"endpoint_url": proxy.url})
    )
    assert summary.status == "converted"
    got = download_folder(moto.url, f"s3://{bucket}/out", tmp_path / "got")
    weights = sorted(p.name for p in local.glob("model*.safetensors"))
    assert weights and sorted(p.name for p in got.glob("model*.safetensors")) == weights
    for name in weights:
        assert (got / name).read_bytes() == (local / name).read_bytes(), name

    [merge] = trace.merges
    print(f"\nmerge: {merge}, GETs on the wire {wire}")
    assert wire == [merge["requests"]]  # the storage counter counts what goes over the wire
    assert merge["requests"] <= merge_request_bound(merge, options)
    assert merge["requests"] * 4 < merge["fragments"]
    assert trace.gates and all(0 < g.peak <= g.limit for g in trace.gates)
    assert all(g.held == 0 for g in trace.gates)


@pytest.mark.slow
def test_peak_rss_of_a_conversion_from_s3_stays_within_the_budget(
    moto: MotoServer, bucket: str, aws_home: Path, tmp_path: Path
) -> None:
    """A conversion S3 -> S3 whose merge reads 2.5x the task's budget: the process grows by at
    most the budget (its own process: ru_maxrss is per process), coalesced reads included."""
    import json
    import os
    import subprocess
    import sys

    from bench.forge import forge_checkpoint, transformer_shapes
    from tests.conftest import REPO, SAMPLE_CKPT
    from tests.io.s3.support import aws_env

    budget = 48 * 2**20
    ckpt = tmp_path / "ckpt"
    forge_checkpoint(
        ckpt, shapes=transformer_shapes(30_000_000), stage=3, world_size=16, dtype="bf16"
    )
    src = upload_folder(moto.url, ckpt, bucket, "ckpt")
    warm = upload_folder(moto.url, SAMPLE_CKPT, bucket, "warm")
    env = {**os.environ, **aws_env(aws_home), "AWS_ENDPOINT_URL": moto.url}
    env["ZEROSAFE_PROBE_WARM"] = warm
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "memory_probe.py"), "engine", src,
         f"s3://{bucket}/out", json.dumps({"memory": budget})],
        capture_output=True, text=True, timeout=900, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = result["peak_rss"] - result["baseline_rss"]
    print(
        f"\nS3 -> S3, 30M params at world size 16 (120 MB of fp32 masters): baseline "
        f"{result['baseline_rss'] / 2**20:.0f} MiB, grew {grew / 2**20:.1f} MiB (budget "
        f"{budget / 2**20:.0f} MiB) in {result['seconds']:.1f} s"
    )
    assert result["status"] == "converted"
    assert grew <= budget
