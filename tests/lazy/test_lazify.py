"""`zerosafe lazify` and `zerosafe.lazy_torch_load` on small tag folders laid out as DeepSpeed
lays them out (files written by torch.save): idempotence, stale siblings, unsafe pickles,
`map_location`, restoring `torch.load`, threads, S3. The real DeepSpeed resume is in
test_resume.py."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.io.s3.support import MotoServer, object_keys, s3_client
from tests.pt2st.helpers import assert_same
from zerosafe import lazy_torch_load
from zerosafe.errors import ConfigError, UnsafePickleError
from zerosafe.io.storage import Storage
from zerosafe.lazy import lazify_checkpoint, sibling_path_for, sibling_state
from zerosafe_app.cli import main

TAG = "global_step5"
MODEL = "mp_rank_00_model_states.pt"
OPTIM = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]


def _model_states(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 16, generator=g)
    return {
        "module": {"emb.weight": w, "head.weight": w, "norm.bias": torch.randn(16, generator=g)},
        "param_shapes": [{"emb.weight": torch.Size([48, 16])}],
        "global_steps": 5,
    }


def _optim_states(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(400, generator=g)
    return {
        "optimizer_state_dict": {
            "single_partition_of_fp32_groups": [flat],
            "base_optimizer_state": {
                "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(400, generator=g)}},
                "param_groups": [{"lr": 0.01, "params": [0]}],
            },
            "partition_count": [2],
        },
        "ds_version": "0.19.8",
    }


def _make_checkpoint(root: Path, seed: int = 0) -> Path:
    tag_dir = root / TAG
    tag_dir.mkdir(parents=True, exist_ok=True)
    (root / "latest").write_text(TAG)
    torch.save(_model_states(seed), tag_dir / MODEL)
    for rank, name in enumerate(OPTIM):
        torch.save(_optim_states(seed * 10 + rank), tag_dir / name)
    return tag_dir


def _siblings(tag_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in tag_dir.glob("*.pt.safetensors")}


def test_lazify_writes_every_sibling_once_and_leaves_the_pt_files(tmp_path: Path) -> None:
    tag_dir = _make_checkpoint(tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in tag_dir.glob("*.pt")}
    assert main(["lazify", str(tmp_path / "ckpt"), "--memory", "80MiB"]) == 0
    written = _siblings(tag_dir)
    assert sorted(written) == sorted(n + ".safetensors" for n in [MODEL, *OPTIM])
    assert {p.name: p.read_bytes() for p in tag_dir.glob("*.pt")} == before
    # a second run finds every sibling current and writes nothing
    again = lazify_checkpoint(str(tmp_path / "ckpt"), memory=80 * 2**20)
    assert (again["current"], again["written"], again["rewritten"]) == (3, 0, 0)
    assert again["bytes_written"] == 0
    assert _siblings(tag_dir) == written
    # and each sibling loads back as torch.load gives the .pt
    want = {name: _plain_load(tag_dir / name) for name in [MODEL, *OPTIM]}
    with lazy_torch_load() as loads:
        for name in [MODEL, *OPTIM]:
            got = torch.load(tag_dir / name, map_location="cpu", weights_only=False)
            assert_same(got, want[name])
    assert sorted(Path(p).name for p in loads.loaded) == sorted([MODEL, *OPTIM])
    assert loads.fell_back == []


def _plain_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_stale_sibling_is_ignored_then_rewritten(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    tag_dir = _make_checkpoint(ckpt, seed=1)
    lazify_checkpoint(str(ckpt), memory=80 * 2**20)
    old_sibling = (tag_dir / (OPTIM[1] + ".safetensors")).read_bytes()
    torch.save(_optim_states(999), tag_dir / OPTIM[1])  # training saved this tag again
    state = sibling_state(Storage(), str(tag_dir / OPTIM[1]))
    assert state.state == "stale" and "version" in state.why
    with lazy_torch_load() as loads:
        got = torch.load(str(tag_dir / OPTIM[1]), map_location="cpu", weights_only=False)
    assert_same(got, _plain_load(tag_dir / OPTIM[1]))  # the new .pt, not the old sibling
    assert [Path(p).name for p, _ in loads.fell_back] == [OPTIM[1]]
    assert "stale" in loads.fell_back[0][1]
    summary = lazify_checkpoint(str(ckpt), memory=80 * 2**20)
    assert (summary["current"], summary["rewritten"]) == (2, 1)
    (rewritten,) = [f for f in summary["files"] if f["status"] == "rewritten"]
    assert rewritten["file"].endswith(OPTIM[1]) and "version" in rewritten["stale_because"]
    assert (tag_dir / (OPTIM[1] + ".safetensors")).read_bytes() != old_sibling
    with lazy_torch_load() as loads:
        got = torch.load(str(tag_dir / OPTIM[1]), map_location="cpu")
    assert_same(got, _plain_load(tag_dir / OPTIM[1]))
    assert [Path(p).name for p in loads.loaded] == [OPTIM[1]]


class _RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch PWNED",))


def test_unsafe_pt_is_refused_and_nothing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    tag_dir = _make_checkpoint(ckpt)
    torch.save({"module": {}, "evil": _RunsCode()}, tag_dir / OPTIM[0])
    monkeypatch.chdir(tmp_path)
    assert main(["lazify", str(ckpt), "--memory", "80MiB"]) == 2
    err = capsys.readouterr().err
    assert OPTIM[0] in err and "posix.system" in err and "allowlist" in err
    assert not (tmp_path / "PWNED").exists()
    assert not (tag_dir / (OPTIM[0] + ".safetensors")).exists()
    # the other files were still lazified
    assert (tag_dir / (OPTIM[1] + ".safetensors")).exists()
    with pytest.raises(UnsafePickleError, match=OPTIM[0]):
        lazify_checkpoint(str(ckpt), memory=80 * 2**20)
    # inside the block, the refused file loads as torch.load loads it (no sibling)
    with lazy_torch_load() as loads:
        with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
            torch.load(tag_dir / OPTIM[0])
    assert loads.fell_back and loads.fell_back[0][1] == "no sibling"


def test_memory_below_the_minimum_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lazify", "/nonexistent", "--memory", "10MiB"]) == 2
    assert "`--memory`" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        lazify_checkpoint("/nonexistent", memory=10 * 2**20)


def test_map_location_and_fallbacks(tmp_path: Path) -> None:
    tag_dir = _make_checkpoint(tmp_path / "ckpt", seed=3)
    lazify_checkpoint(str(tmp_path / "ckpt"), memory=80 * 2**20)
    path = tag_dir / MODEL
    want = _plain_load(path)
    original = torch.load
    with lazy_torch_load() as loads:
        assert torch.load is not original
        for where in ("cpu", torch.device("cpu"), None, lambda storage, loc: storage):
            assert_same(torch.load(path, map_location=where, weights_only=False), want)
        assert len(loads.loaded) == 4
        # a dict, a file object and a custom pickle_module go to the real torch.load
        assert_same(torch.load(path, map_location={"cpu": "cpu"}, weights_only=True), want)
        with open(path, "rb") as f:
            assert_same(torch.load(f, weights_only=True), want)
        assert len(loads.loaded) == 4
        reasons = [why for _, why in loads.fell_back]
        assert "map_location" in reasons[0] and reasons[1] == "not a path"
        # a tensor of the sibling is a window onto its memory map (nothing copied)
        lazy = torch.load(path, map_location="cpu")
        lazy["module"]["emb.weight"].add_(1)  # copy-on-write: the file is unchanged
        assert lazy["module"]["head.weight"].data_ptr() == lazy["module"]["emb.weight"].data_ptr()
    assert torch.load is original
    assert_same(_plain_load(path), want)
    with lazy_torch_load():
        assert_same(torch.load(path, map_location="cpu"), want)


def test_blocks_nest_and_overlap_across_threads(tmp_path: Path) -> None:
    tag_dir = _make_checkpoint(tmp_path / "ckpt", seed=4)
    lazify_checkpoint(str(tmp_path / "ckpt"), memory=80 * 2**20)
    original = torch.load
    inside = threading.Barrier(2)
    results: dict[int, list[str]] = {}

    def worker(i: int) -> None:
        with lazy_torch_load() as loads:
            inside.wait()  # both blocks open at once
            torch.load(tag_dir / OPTIM[i], map_location="cpu")
            inside.wait()
        results[i] = [Path(p).name for p in loads.loaded]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    with lazy_torch_load() as outer:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.load(tag_dir / MODEL, map_location="cpu")
    assert results == {0: [OPTIM[0]], 1: [OPTIM[1]]}  # each thread's calls in its own block
    assert [Path(p).name for p in outer.loaded] == [MODEL]
    assert torch.load is original


def test_lazify_on_s3(moto: MotoServer, bucket: str, tmp_path: Path) -> None:
    tag_dir = _make_checkpoint(tmp_path / "ckpt", seed=5)
    client = s3_client(moto.url)
    client.put_object(Bucket=bucket, Key="run/ckpt/latest", Body=TAG.encode())
    for p in tag_dir.glob("*.pt"):
        client.put_object(Bucket=bucket, Key=f"run/ckpt/{TAG}/{p.name}", Body=p.read_bytes())
    options = {"endpoint_url": moto.url}
    url = f"s3://{bucket}/run/ckpt"
    rc = main(["lazify", url, "--memory", "80MiB", "--storage-option", f"endpoint_url={moto.url}"])
    assert rc == 0
    keys = object_keys(moto.url, bucket)
    assert sorted(k for k in keys if k.endswith(".safetensors")) == sorted(
        f"run/ckpt/{TAG}/{n}.safetensors" for n in [MODEL, *OPTIM]
    )
    again = lazify_checkpoint(url, storage=Storage(options), memory=80 * 2**20)
    assert again["current"] == 3 and again["bytes_written"] == 0
    from zerosafe.pt2st import load_pt_like

    sibling = sibling_path_for(f"{url}/{TAG}/{OPTIM[0]}")
    assert_same(load_pt_like(sibling, storage_options=options), _plain_load(tag_dir / OPTIM[0]))


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _make_checkpoint(tmp_path / "ckpt", seed=6)
    assert (
        main(["lazify", str(tmp_path / "ckpt"), "--tag", TAG, "--json", "--memory", "80MiB"]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["tag"] == TAG and summary["written"] == 3


def test_object_nodes_rebuild_only_listed_classes() -> None:
    from zerosafe.errors import CheckpointFormatError
    from zerosafe.pt2st.tree import REBUILT_CLASSES, decode_tree

    doc = {"object": ["posix.system", [{"bytes": "dG91Y2ggUFdORUQ="}], None]}
    with pytest.raises(CheckpointFormatError, match="'posix.system', which zerosafe does not"):
        decode_tree(doc, lambda node: None)
    # checking a file (verify_pt) passes its own object maker: nothing is imported
    seen: list[tuple[str, list[Any], Any]] = []
    stage = {"object": [REBUILT_CLASSES[2], [2], None]}
    assert decode_tree(
        {"dict": [["zero_stage", stage]]}, lambda n: None, lambda *a: seen.append(a)
    ) == {"zero_stage": None}
    assert seen == [(REBUILT_CLASSES[2], [2], None)]
