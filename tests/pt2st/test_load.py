"""Loading: the resume helper `load_pt` (x.pt -> x.safetensors when present and current),
reading without a memory map, plain safetensors files, and a CUDA device when there is one."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.pt2st.helpers import assert_same, roundtrip
from zerosafe.pt2st import convert_pt, load_pt, load_pt_like, safetensors_path_for


def _checkpoint() -> dict[str, object]:
    base = torch.randn(6, 4)
    return {
        "model": {"w": base, "w_t": base.t(), "b": torch.zeros(4, dtype=torch.bfloat16)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(6, 4)}}},
        "step": 3,
    }


def test_safetensors_path_for() -> None:
    assert safetensors_path_for("/a/x.pt") == "/a/x.safetensors"
    assert safetensors_path_for("s3://b/step10/model.pth") == "s3://b/step10/model.safetensors"
    assert safetensors_path_for("/a/x.ckpt") == "/a/x.safetensors"
    assert safetensors_path_for("/a/weights") == "/a/weights.safetensors"


def test_load_pt_prefers_the_current_conversion(tmp_path: Path, caplog) -> None:
    pt = tmp_path / "x.pt"
    torch.save(_checkpoint(), pt)
    convert_pt(str(pt), safetensors_path_for(str(pt)))
    with caplog.at_level(logging.INFO, logger="zerosafe"):
        got = load_pt(str(pt))
    assert "x.safetensors instead" in caplog.text
    assert_same(got, torch.load(pt))
    # The .pt may be gone (only the conversion was copied to the training machine).
    pt.unlink()
    assert_same(load_pt(str(pt)), got)


def test_load_pt_ignores_a_stale_conversion(tmp_path: Path, caplog) -> None:
    pt = tmp_path / "x.pt"
    torch.save(_checkpoint(), pt)
    convert_pt(str(pt), safetensors_path_for(str(pt)))
    time.sleep(0.01)
    newer = {**_checkpoint(), "step": 4}
    torch.save(newer, pt)  # training wrote a newer checkpoint after the conversion
    os.utime(pt, (time.time() + 5, time.time() + 5))
    with caplog.at_level(logging.WARNING, logger="zerosafe"):
        got = load_pt(str(pt))
    assert "not using" in caplog.text and got["step"] == 4


def test_load_pt_without_a_conversion_uses_torch_load(tmp_path: Path) -> None:
    pt = tmp_path / "x.pt"
    torch.save(_checkpoint(), pt)
    assert_same(load_pt(str(pt)), torch.load(pt))


def test_load_without_mmap(tmp_path: Path) -> None:
    got, want, _ = roundtrip(_checkpoint(), tmp_path, mmap=False)
    assert_same(got, want)


def test_plain_safetensors_load_as_a_dict(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(3), "b": torch.arange(4)}
    save_file(tensors, tmp_path / "plain.safetensors")
    got = load_pt_like(str(tmp_path / "plain.safetensors"))
    assert set(got) == {"a", "b"} and all(torch.equal(got[k], v) for k, v in tensors.items())


def _device_roundtrip(tmp_path: Path, device: str) -> None:
    pt = tmp_path / "x.pt"
    obj = _checkpoint()
    obj["param"] = torch.nn.Parameter(torch.randn(5))
    torch.save(obj, pt)
    out = tmp_path / "x.safetensors"
    convert_pt(str(pt), str(out))
    # A tiny staging buffer: every storage goes over in several chunks.
    got = load_pt_like(str(out), device=device, staging_bytes=16)
    want = torch.load(pt, map_location=device)
    assert got["model"]["w"].device.type == torch.device(device).type
    assert_same(got, want)
    w, w_t = got["model"]["w"], got["model"]["w_t"]
    assert w.untyped_storage().data_ptr() == w_t.untyped_storage().data_ptr()
    assert isinstance(got["param"], torch.nn.Parameter) and got["param"].requires_grad


def test_chunked_reads_without_mmap(tmp_path: Path) -> None:
    pt = tmp_path / "x.pt"
    torch.save(_checkpoint(), pt)
    out = tmp_path / "x.safetensors"
    convert_pt(str(pt), str(out))
    got = load_pt_like(str(out), device="cpu", mmap=False, staging_bytes=16)
    assert_same(got, torch.load(pt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_onto_cuda(tmp_path: Path) -> None:
    _device_roundtrip(tmp_path, "cuda:0")
    pt = tmp_path / "x.pt"
    got = load_pt(str(pt), device="cuda:0")
    assert got["model"]["w"].is_cuda
