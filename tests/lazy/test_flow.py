"""The Prefect flow `lazify` (what the `lazify/default` deployment runs), in process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.io.s3.support import ACCESS_KEY, SECRET_KEY, MotoServer, object_keys, s3_client
from tests.lazy.test_lazify import MODEL, OPTIM, TAG, _make_checkpoint
from zerosafe import lazy_torch_load
from zerosafe.errors import ConfigError


@pytest.mark.slow
def test_flow_writes_siblings_then_finds_them_current(prefect_server: None, tmp_path: Path) -> None:
    from flows.lazify import lazify  # the deployment's entrypoint

    tag_dir = _make_checkpoint(tmp_path / "ckpt", seed=8)
    result = lazify(checkpoint=str(tmp_path / "ckpt"), memory="80MiB", parallel=2)
    assert (result["written"], result["current"]) == (3, 0)
    assert {Path(f["sibling"]).name for f in result["files"]} == {
        n + ".safetensors" for n in [MODEL, *OPTIM]
    }
    again = lazify(checkpoint=str(tag_dir))  # a tag folder works too
    assert (again["written"], again["current"]) == (0, 3)
    with lazy_torch_load() as loads:
        torch.load(tag_dir / OPTIM[0], map_location="cpu")
    assert loads.loaded == [str(tag_dir / OPTIM[0])]
    with pytest.raises(ConfigError, match="credentials may not be flow parameters"):
        lazify(checkpoint=str(tag_dir), storage_options={"secret": "x"})


@pytest.mark.slow
def test_flow_on_s3_with_credentials_from_a_secret_block(
    prefect_server: None,
    moto: MotoServer,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 24, 11: `credentials=secret/NAME` reaches the flow's tasks (each once built
    `Storage(...)` itself, which refuses an unresolved block reference)."""
    from prefect.blocks.system import Secret

    from flows.lazify import lazify

    tag_dir = _make_checkpoint(tmp_path / "ckpt", seed=9)
    client = s3_client(moto.url)
    client.put_object(Bucket=bucket, Key="run/ckpt/latest", Body=TAG.encode())
    for p in tag_dir.glob("*.pt"):
        client.put_object(Bucket=bucket, Key=f"run/ckpt/{TAG}/{p.name}", Body=p.read_bytes())
    Secret(value={"aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY}).save(
        "zs-test-lazify", overwrite=True
    )
    # Credentials only in the Secret block: none in this process's environment.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    options = {"endpoint_url": moto.url, "credentials": "secret/zs-test-lazify"}
    result = lazify(checkpoint=f"s3://{bucket}/run/ckpt", storage_options=options, memory="80MiB")
    assert (result["written"], result["current"]) == (3, 0)
    assert sorted(k for k in object_keys(moto.url, bucket) if k.endswith(".safetensors")) == sorted(
        f"run/ckpt/{TAG}/{n}.safetensors" for n in [MODEL, *OPTIM]
    )
