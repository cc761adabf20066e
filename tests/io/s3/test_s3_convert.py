"""Conversions to and from a real S3 server (the engine, no Prefect): bit-exact against the local
conversion, and the bytes read from the source bucket counted on the wire."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SAMPLE_CKPT
from tests.io.s3.faultproxy import FaultProxy
from tests.io.s3.support import (
    MotoServer,
    assert_same_output,
    download_folder,
    incomplete_uploads,
    object_keys,
    s3_client,
    upload_folder,
)
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.formats.deepspeed.checkpoint import open_zero_checkpoint
from zerosafe.io.storage import Storage


@pytest.mark.parametrize("route", ["s3-s3", "s3-local", "local-s3"])
def test_conversion_is_bit_exact(
    route: str,
    moto: MotoServer,
    bucket: str,
    proxy: FaultProxy,
    local_reference: Path,
    tmp_path: Path,
) -> None:
    src_kind, out_kind = route.split("-")
    src = (
        upload_folder(moto.url, SAMPLE_CKPT, bucket, "ckpt")
        if src_kind == "s3"
        else str(SAMPLE_CKPT)
    )
    out = f"s3://{bucket}/out" if out_kind == "s3" else str(tmp_path / "out")
    # 8 KiB parts: the intermediates and the output go up as real multipart uploads.
    storage = Storage({"endpoint_url": proxy.url, "part_size": 8192})
    summary = convert_checkpoint(src, out, ConvertOptions(), storage=storage)
    assert summary.status == "converted"
    local = download_folder(moto.url, out, tmp_path / "got") if out_kind == "s3" else Path(out)
    assert_same_output(local, local_reference)
    if out_kind == "s3":
        parts = [r for r in proxy.requests("PUT") if "partNumber=" in r.query]
        assert len(parts) > 8  # model.safetensors alone is 60 KB
        assert incomplete_uploads(moto.url, bucket) == []
        assert not any(".zerosafe-work" in k for k in object_keys(moto.url, bucket))
    again = convert_checkpoint(
        src, out, ConvertOptions(), storage=Storage({"endpoint_url": moto.url})
    )
    assert again.status == "already-complete"


def _needed_bytes(ckpt_url: str, storage: Storage) -> tuple[int, int, int]:
    """(fp32 masters + frozen + buffers, pickles, zip directories) of a checkpoint."""
    from zerosafe.formats.deepspeed.checkpoint import build_plan

    ckpt = open_zero_checkpoint(storage, ckpt_url)
    plan = build_plan(ckpt, ConvertOptions())
    pickles = sum(f.zip.records[f.zip.prefix + "data.pkl"].size_bytes for f in ckpt.files)
    directories = sum(f.zip.directory_bytes for f in ckpt.files)
    return plan.slot_bytes, pickles, directories


@pytest.mark.parametrize("which", ["sample", "forged"])
def test_bytes_read_from_s3_are_masters_pickles_and_directories(
    which: str, moto: MotoServer, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    if which == "forged":  # a bigger one: 3 MB of optimizer files, 1.2 MB of fp32 masters
        from bench.forge import forge_checkpoint, transformer_shapes

        folder = tmp_path / "forged"
        forge_checkpoint(
            folder, shapes=transformer_shapes(300_000), stage=3, world_size=3, dtype="bf16"
        )
    else:
        folder = SAMPLE_CKPT
    src = upload_folder(moto.url, folder, bucket, "ckpt")
    masters, pickles, directories = _needed_bytes(str(folder), Storage())
    needed = masters + pickles + directories
    checkpoint_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    storage = Storage({"endpoint_url": proxy.url, "range_size": 256 * 1024})
    summary = convert_checkpoint(src, f"s3://{bucket}/out", ConvertOptions(), storage=storage)

    on_wire = proxy.body_bytes("GET", f"/{bucket}/ckpt/")
    ratio = on_wire / needed
    print(
        f"\n{which}: read {on_wire} B from S3 of the {checkpoint_bytes} B checkpoint "
        f"({on_wire / checkpoint_bytes:.1%}); needed {needed} B = masters+frozen+buffers "
        f"{masters} + pickles {pickles} + zip directories {directories}; ratio {ratio:.4f}"
    )
    assert needed <= on_wire <= 1.05 * needed
    assert on_wire < 0.5 * checkpoint_bytes  # the Adam moments stay in the bucket
    # The engine's own count is what went over the wire (no retries happened here), but for
    # the `latest` file, which is not part of the tag.
    assert on_wire == summary.stats.source_bytes_read + (folder / "latest").stat().st_size
    gets = proxy.requests("GET", f"/{bucket}/ckpt/")
    assert all(g.range is not None for g in gets if not g.path.endswith("/latest"))


def test_verify_reads_s3_output_and_catches_corruption(
    moto: MotoServer, bucket: str, tmp_path: Path
) -> None:
    from zerosafe.verify.output import verify_output

    storage = Storage({"endpoint_url": moto.url})
    out = f"s3://{bucket}/out"
    convert_checkpoint(str(SAMPLE_CKPT), out, ConvertOptions(), storage=storage)
    report = verify_output(out, storage=storage)
    assert report["ok"], report["failures"]
    assert report["complete"] and report["num_tensors"] == 20

    env = {**os.environ, "PYTHONPATH": str(REPO), "AWS_ENDPOINT_URL": moto.url}
    upload_folder(moto.url, SAMPLE_CKPT, bucket, "ckpt")
    inspect = subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "inspect", f"s3://{bucket}/ckpt", "--json"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert inspect.returncode == 0, inspect.stderr
    assert '"world_size": 3' in inspect.stdout
    cmd = [sys.executable, "-m", "zerosafe_app.cli", "verify", out]
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("OK")

    client = s3_client(moto.url)
    key = "out/model.safetensors"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-5] ^= 0x40
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    bad = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "checksum" in bad.stdout


def test_model_files_on_s3(
    moto: MotoServer, bucket: str, sample_ckpt: Path, tmp_path: Path
) -> None:
    """config.json and tokenizer files beside `latest` in a bucket are copied into an S3
    output, recorded, verified, and copied again after they change there."""
    from zerosafe.verify.output import verify_output

    (sample_ckpt / "config.json").write_text('{"tie_word_embeddings": true}')
    (sample_ckpt / "tokenizer.json").write_text('{"model": {}}')
    (sample_ckpt / "additional_chat_templates").mkdir()
    (sample_ckpt / "additional_chat_templates" / "tool.jinja").write_text("{{ x }}")
    src = upload_folder(moto.url, sample_ckpt, bucket, "run/ckpt")
    out = f"s3://{bucket}/hf"
    storage = Storage({"endpoint_url": moto.url})
    assert convert_checkpoint(src, out, ConvertOptions(), storage=storage).status == "converted"
    got = download_folder(moto.url, out, tmp_path / "got")
    for name in ("config.json", "tokenizer.json", "additional_chat_templates/tool.jinja"):
        assert (got / name).read_bytes() == (sample_ckpt / name).read_bytes(), name
    assert verify_output(out, storage=storage)["ok"]
    s3_client(moto.url).put_object(Bucket=bucket, Key="hf/tokenizer.json", Body=b"{}")
    failures = verify_output(out, storage=storage)["failures"]
    assert [(f["file"], f["check"]) for f in failures] == [("tokenizer.json", "model file")]
    again = convert_checkpoint(src, out, ConvertOptions(), storage=storage)
    assert again.status == "converted" and verify_output(out, storage=storage)["ok"]
    assert convert_checkpoint(src, out, storage=storage).status == "already-complete"
