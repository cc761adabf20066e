"""pt2st against a real S3 server (moto on loopback) and through the Prefect flow `pt2st`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.io.s3.support import ACCESS_KEY, SECRET_KEY, MotoServer, object_keys, s3_client
from tests.pt2st.helpers import assert_same
from zerosafe.errors import ConfigError
from zerosafe.io.storage import Storage
from zerosafe.pt2st import convert_pt, load_pt, load_pt_like, verify_pt


def _checkpoint() -> dict[str, object]:
    base = torch.randn(64, 32)
    return {
        "model": {"w": base, "w_t": base.t(), "emb": torch.randn(100, 8).to(torch.bfloat16)},
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(64, 32)}}},
        "step": 7,
        "lr": float("nan"),
    }


def _upload(moto: MotoServer, bucket: str, key: str, path: Path) -> str:
    s3_client(moto.url).put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    return f"s3://{bucket}/{key}"


def test_s3_to_s3_and_lazy_load_back(moto: MotoServer, bucket: str, tmp_path: Path) -> None:
    pt = tmp_path / "model.pt"
    torch.save(_checkpoint(), pt)
    src = _upload(moto, bucket, "run/step7/model.pt", pt)
    options = {"endpoint_url": moto.url, "part_size": 8192}
    dst = f"s3://{bucket}/run/step7/model.safetensors"
    summary = convert_pt(src, dst, storage=Storage(options), memory=64 * 2**20)
    assert summary["status"] == "converted"
    assert sorted(object_keys(moto.url, bucket)) == [
        "run/step7/model.pt",
        "run/step7/model.safetensors",
    ]
    verify_pt(dst, storage=Storage(options), expected_sha256=summary["sha256"])
    want = torch.load(pt)
    assert_same(load_pt_like(dst, storage_options=options), want)
    assert_same(load_pt(src, storage_options=options), want)  # finds the conversion beside it


@pytest.mark.slow
def test_flow_local_then_rerun(prefect_server: None, tmp_path: Path) -> None:
    from zerosafe_app.flows.pt2st import pt2st

    pt = tmp_path / "optim.pt"
    torch.save(_checkpoint(), pt)
    result = pt2st(source=str(pt), memory="64MiB")
    out = tmp_path / "optim.safetensors"
    assert result["status"] == "converted" and result["destination"] == str(out)
    assert (
        result["verify"]["ok"] and result["verify"]["checksums_compared"] == result["num_entries"]
    )
    assert_same(load_pt_like(str(out)), torch.load(pt))
    again = pt2st(source=str(pt), destination=str(out))
    assert again["status"] == "already-complete" and again["verify"]["ok"]


@pytest.mark.slow
def test_flow_on_s3(prefect_server: None, moto: MotoServer, bucket: str, tmp_path: Path) -> None:
    from zerosafe_app.flows.pt2st import pt2st

    pt = tmp_path / "model.pt"
    torch.save(_checkpoint(), pt)
    src = _upload(moto, bucket, "ckpt/model.pt", pt)
    options = {"endpoint_url": moto.url}
    result = pt2st(source=src, storage_options=options)
    assert result["status"] == "converted" and result["verify"]["ok"]
    assert result["destination"] == f"s3://{bucket}/ckpt/model.safetensors"
    assert_same(load_pt_like(result["destination"], storage_options=options), torch.load(pt))


@pytest.mark.slow
def test_flow_on_s3_with_credentials_from_a_secret_block(
    prefect_server: None,
    moto: MotoServer,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 24, 11: `credentials=secret/NAME` reaches every task of the flow (each once built
    `Storage(...)` itself, which refuses an unresolved block reference)."""
    from prefect.blocks.system import Secret

    from zerosafe_app.flows.pt2st import pt2st

    pt = tmp_path / "model.pt"
    torch.save(_checkpoint(), pt)
    src = _upload(moto, bucket, "secret/model.pt", pt)
    Secret(value={"aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY}).save(
        "zs-test-pt2st", overwrite=True
    )
    # Credentials only in the Secret block: none in this process's environment.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    options = {"endpoint_url": moto.url, "credentials": "secret/zs-test-pt2st"}
    result = pt2st(source=src, storage_options=options)
    assert result["status"] == "converted" and result["verify"]["ok"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    got = load_pt_like(result["destination"], storage_options={"endpoint_url": moto.url})
    assert_same(got, torch.load(pt))


def test_flow_refuses_secrets_as_parameters(tmp_path: Path) -> None:
    from zerosafe_app.flows.pt2st import pt2st

    with pytest.raises(ConfigError, match="storage_options.secret"):
        pt2st.fn(source=str(tmp_path / "x.pt"), storage_options={"secret": "s3cr3t"})


def test_cli_on_s3(moto: MotoServer, bucket: str, tmp_path: Path, capsys) -> None:
    from zerosafe_app.cli import main

    pt = tmp_path / "model.pt"
    torch.save(_checkpoint(), pt)
    src = _upload(moto, bucket, "cli/model.pt", pt)
    assert main(["pt2st", src, "--storage-option", f"endpoint_url={moto.url}", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (
        summary["verify"]["ok"] and summary["destination"] == f"s3://{bucket}/cli/model.safetensors"
    )
    assert main(["pt2st", src, "--storage-option", "secret=abc"]) == 2
    assert "secret" in capsys.readouterr().err
