"""A Megatron-LM `--save` folder on a real S3 server on loopback (moto), converted to S3:
detection from listings, the same tensors and `config.json` as from local files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.formats.megatron.conftest import live_weights, save_path, saved_args
from tests.formats.megatron.reference import hf_reference
from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
from tests.io.s3.support import MotoServer, download_folder, upload_folder
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.io.storage import Storage


def test_save_folder_on_s3_converts_to_s3(
    tmp_path: Path,
    moto: MotoServer,  # noqa: F811 - fixture
    bucket: str,  # noqa: F811 - fixture
) -> None:
    src = upload_folder(moto.url, save_path("tp2"), bucket, "megatron/tp2")
    out = f"s3://{bucket}/megatron-out/tp2"
    convert_checkpoint(src, out, ConvertOptions(), storage=Storage({"endpoint_url": moto.url}))
    got_dir = download_folder(moto.url, out, tmp_path / "got")
    want = hf_reference(live_weights("tp2"), saved_args("tp2"))
    got = load_file(str(got_dir / "model.safetensors"))
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((got_dir / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["vocab_size"] == 53
