"""DeepSpeed universal checkpoints: real ZeRO checkpoints trained with DeepSpeed on CPU ranks,
turned universal by DeepSpeed's own `ds_to_universal.py`, converted by zerosafe and compared,
byte for byte, with the live training weights and with converting the original ZeRO checkpoint.

The checkpoints are trained once per session, lazily. Set ZEROSAFE_DS_CACHE=/some/dir to keep
them between local runs (entries keyed by a hash of the spec and of `train_zero.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.io.s3.support import run_zerosafe
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import (
    CheckpointFormatError,
    LayoutMismatchError,
    UnsupportedCheckpointError,
)
from zerosafe.verify.output import verify_output
from zerosafe_app.cli import main

try:
    from tests.deepspeed_gen import SPECS, ds_to_universal, spec_key, train_checkpoint
except ImportError:  # tests/ not importable as a package: load it from its folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from deepspeed_gen import SPECS, ds_to_universal, spec_key, train_checkpoint

pytestmark = pytest.mark.slow

SOURCES = [
    "z1-bf16-ws2-frozen-groups",  # ZeRO-1: frozen params only in the 16-bit module copy
    "z2-bf16-ws2-legacy-tied-frozen",  # ZeRO-2, tied, frozen fragments, legacy model states
    "z3-fp32-ws3-subgroups-tied-frozen",  # ZeRO-3: bare flat fp32.pt, frozen fragments per rank
    "z1-bf16master-ws2-zerosize-groups",  # bf16 masters in fp32.pt, zero-element params
]
ROUND_ROBIN = "z2-fp16-ws3-rr-frozen-groups"
MOMENTS = ("exp_avg.pt", "exp_avg_sq.pt", "step.pt")
MANIFEST = "zerosafe-manifest.json"
SMALL_SHARDS = 12_000


@dataclass
class Made:
    name: str
    spec: dict[str, Any]
    root: Path
    """The ZeRO checkpoint folder: `latest`, the ZeRO tag, `latest_universal` and the
    universal folder ds_to_universal.py wrote beside the tag."""
    tag: str
    utag: str
    live: Path

    @property
    def universal(self) -> Path:
        return self.root / self.utag


def _make(spec: dict[str, Any], dest: Path) -> None:
    ckpt = train_checkpoint(spec, dest)
    tag = (ckpt / "latest").read_text().strip()
    ds_to_universal(ckpt / tag, ckpt / f"{tag}_universal")
    (dest / "done.json").write_text(json.dumps(spec))


@pytest.fixture(scope="session")
def made(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Made]:
    """name -> Made: trains the spec and runs ds_to_universal.py on it, once per session."""
    cache_env = os.environ.get("ZEROSAFE_DS_CACHE")
    cache = Path(cache_env).expanduser() if cache_env else None
    done: dict[str, Made] = {}

    def get(name: str) -> Made:
        if name not in done:
            spec = SPECS[name]
            if cache is None:
                root = tmp_path_factory.mktemp(f"universal-{name}")
                _make(spec, root)
            else:
                root = cache / f"universal-{name}-{spec_key(spec)}"
                if not (root / "done.json").is_file():
                    scratch = cache / f".{root.name}.{os.getpid()}.tmp"
                    shutil.rmtree(scratch, ignore_errors=True)
                    _make(spec, scratch)
                    shutil.rmtree(root, ignore_errors=True)
                    scratch.rename(root)
            ckpt = root / "ckpt"
            tag = (ckpt / "latest").read_text().strip()
            utag = (ckpt / "latest_universal").read_text().strip()
            done[name] = Made(name, spec, ckpt, tag, utag, root / "live.safetensors")
        return done[name]

    return get


@dataclass
class Output:
    dir: Path
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def _read(out: Path) -> Output:
    manifest = json.loads((out / MANIFEST).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(p.name for p in out.glob("model*.safetensors")):
        with safe_open(str(out / f), "pt") as handle:
            for key in handle.keys():
                assert key not in tensors, key
                tensors[key] = handle.get_tensor(key)
    return Output(out, manifest, tensors)


@pytest.fixture(scope="session")
def convert(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Output]:
    """convert(source folder, tag=None, **ConvertOptions fields) -> Output, memoized."""
    done: dict[tuple[Any, ...], Output] = {}

    def run(source: Path, tag: str | None = None, **options: Any) -> Output:
        key = (str(source), tag, *sorted(options.items()))
        if key not in done:
            out = tmp_path_factory.mktemp("out") / "o"
            summary = convert_checkpoint(str(source), str(out), ConvertOptions(**options), tag=tag)
            assert summary.status == "converted", summary
            done[key] = _read(out)
        return done[key]

    return run


def assert_same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"
    )
    g = got.contiguous().reshape(-1).view(torch.uint8)
    w = want.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(g, w), f"{what}: bytes differ"


def assert_same_output(got: Output, want: Output) -> None:
    """Same tensors in the same order, dtypes, shapes and bytes, and the same ties."""
    assert list(got.manifest["tensors"]) == list(want.manifest["tensors"])  # output order
    assert set(got.tensors) == set(want.tensors)
    assert got.manifest["aliases"] == want.manifest["aliases"]
    for key, tensor in want.tensors.items():
        assert_same(key, got.tensors[key], tensor)


def _copy_universal(m: Made, dest: Path) -> Path:
    """A writable copy of the universal folder alone."""
    shutil.copytree(m.universal, dest)
    return dest


def _trained(m: Made) -> list[str]:
    """The trained params (names in `param_shapes`), from DeepSpeed's own reading."""
    files = sorted(m.universal.glob("*model_states.pt"))
    state = torch.load(files[0], map_location="cpu", weights_only=False)
    return [n for group in state["param_shapes"] for n in group]


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SOURCES)
def test_equals_original_conversion_and_live_weights(name: str, made, convert) -> None:
    m = made(name)
    ours = convert(m.universal)
    original = convert(m.root)  # `latest`: the ZeRO tag ds_to_universal read
    assert original.manifest["source"]["tag"] == m.tag
    assert ours.manifest["source"]["format"] == "deepspeed-universal"
    assert ours.manifest["source"]["tag"] == m.utag
    assert_same_output(ours, original)

    live = load_file(m.live)
    assert set(ours.tensors) == set(live)
    for key, want in live.items():
        got = ours.tensors[key]
        assert got.dtype == (torch.float32 if want.is_floating_point() else want.dtype), key
        assert_same(key, got.to(want.dtype), want)
    assert ours.manifest["aliases"] == (
        {"lm_head.weight": "embed.weight"} if m.spec.get("tied") else {}
    )
    report = verify_output(str(ours.dir), against=str(m.universal))
    assert report["ok"], report["failures"]


@pytest.mark.parametrize("name", ["z3-fp32-ws3-subgroups-tied-frozen", "z1-bf16-ws2-frozen-groups"])
def test_staged_sharded_and_bf16_output(name: str, made, convert) -> None:
    m = made(name)
    staged = convert(m.universal, direct=False, max_shard_size=SMALL_SHARDS)
    assert len(list(staged.dir.glob("model-*.safetensors"))) > 1
    assert_same_output(staged, convert(m.universal, direct=True))
    assert_same_output(convert(m.universal, dtype="bfloat16"), convert(m.root, dtype="bfloat16"))
    assert_same_output(
        convert(m.universal, exclude_frozen=True), convert(m.root, exclude_frozen=True)
    )


def test_moments_are_never_opened(made, convert, tmp_path: Path) -> None:
    """Without the moments (and the optimizer's common state) the conversion is the same."""
    m = made("z2-bf16-ws2-legacy-tied-frozen")
    folder = _copy_universal(m, tmp_path / m.utag)
    removed = [p for p in (folder / "zero").rglob("*.pt") if p.name in MOMENTS]
    assert len(removed) >= 3 * len(_trained(m))
    for p in removed:
        p.unlink()
    (folder / "zero" / "optimizer_state.pt").unlink()
    for mode in (True, False):
        assert_same_output(convert(folder, direct=mode), convert(m.root))


def test_low_precision_cross_check(made, convert) -> None:
    """ZeRO-1/2 universal folders keep the module's 16-bit copy: `check_lowp` compares it."""
    m = made("z1-bf16-ws2-frozen-groups")
    out = convert(m.universal, check_lowp=True)
    lowp = out.manifest["checks"]["lowp_cross_check"]
    assert lowp["lowp_checked"] == len(_trained(m)) + 3 and lowp["lowp_mismatched"] == 0


def test_missing_fp32_is_refused(made, tmp_path: Path, capsys) -> None:
    m = made("z3-fp32-ws3-subgroups-tied-frozen")
    folder = _copy_universal(m, tmp_path / m.utag)
    (folder / "zero" / "blocks.1.up.weight" / "fp32.pt").unlink()
    with pytest.raises(CheckpointFormatError, match=r"no fp32.pt for 1 trained param\(s\)"):
        convert_checkpoint(str(folder), str(tmp_path / "out"))
    assert main(["convert", "--via", "local", str(folder), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerosafe: error: ") and err.count("\n") == 1, err
    assert "blocks.1.up.weight" in err and "ds_to_universal.py did not finish" in err
    assert not (tmp_path / "out2" / "zerosafe-complete.json").exists()


def test_non_contiguous_master_is_refused(made, tmp_path: Path) -> None:
    m = made("z1-bf16-ws2-frozen-groups")
    folder = _copy_universal(m, tmp_path / m.utag)
    target = folder / "zero" / "blocks.0.up.weight" / "fp32.pt"
    rows, cols = torch.load(target, weights_only=False)["param"].shape
    torch.save({"param": torch.zeros(cols, rows).t(), "cat_dim": 0}, target)
    with pytest.raises(CheckpointFormatError, match="blocks.0.up.weight' are not contiguous"):
        convert_checkpoint(str(folder), str(tmp_path / "out"))


def test_masters_from_another_param_are_caught(made, tmp_path: Path) -> None:
    """ZeRO-1/2: a sample of the masters must equal the model states' 16-bit copy."""
    m = made("z1-bf16-ws2-frozen-groups")
    folder = _copy_universal(m, tmp_path / m.utag)
    a, b = (folder / "zero" / f"blocks.{i}.up.weight" / "fp32.pt" for i in (0, 1))
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    with pytest.raises(LayoutMismatchError, match="master weights of 'blocks.0.up.weight' differ"):
        convert_checkpoint(str(folder), str(tmp_path / "out"))


def test_tensor_parallel_and_foreign_keys_are_refused(made, tmp_path: Path) -> None:
    m = made("z1-bf16-ws2-frozen-groups")
    folder = _copy_universal(m, tmp_path / "tp")
    shutil.copy(folder / "mp_rank_00_model_states.pt", folder / "mp_rank_01_model_states.pt")
    with pytest.raises(UnsupportedCheckpointError, match=r"tensor-parallel run \(mp_rank_01\)"):
        convert_checkpoint(str(folder), str(tmp_path / "out"))

    folder = _copy_universal(m, tmp_path / "expert")
    target = folder / "zero" / "embed.weight" / "fp32.pt"
    state = torch.load(target, weights_only=False)
    torch.save({**state, "is_expert_param": True}, target)
    with pytest.raises(UnsupportedCheckpointError, match=r"\['is_expert_param'\] besides"):
        convert_checkpoint(str(folder), str(tmp_path / "out2"))


def test_round_robin_source_is_refused(made, convert, tmp_path: Path) -> None:
    """ds_to_universal.py places ZeRO-1/2 params by `param_slice_mappings`, wrong under
    `round_robin_gradients`: its fp32.pt files hold other params' values. zerosafe refuses
    the universal folder and converts the original ZeRO checkpoint right."""
    m = made(ROUND_ROBIN)
    original = convert(m.root)
    wrong = []
    for name in _trained(m):
        got = torch.load(m.universal / "zero" / name / "fp32.pt", weights_only=False)["param"]
        if not torch.equal(got, original.tensors[name]):
            wrong.append(name)
    assert wrong, "ds_to_universal got round robin right: lift the refusal"
    with pytest.raises(UnsupportedCheckpointError, match="round_robin_gradients"):
        convert_checkpoint(str(m.universal), str(tmp_path / "out"))


def _inspect(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["inspect", "--json", *args]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def test_inspect_and_which_folder_is_read(made, tmp_path: Path, capsys) -> None:
    m = made("z3-fp32-ws3-subgroups-tied-frozen")
    trained = _trained(m)
    report = _inspect(capsys, str(m.universal))
    assert report["format"] == "deepspeed-universal" and report["tag"] == m.utag
    assert report["zero_stage"] == 3 and report["world_size"] == 3
    assert report["params"]["trained"] == len(trained) == report["fp32_files"]
    assert report["params"]["frozen"] == ["side.weight", "side.bias", "side_out.weight"]
    assert report["params"]["tied"] == {"lm_head.weight": "embed.weight"}
    assert "exp_avg" in report["read_labels"]["never"]

    # The checkpoint folder holds `latest` and `latest_universal`: `latest` (the ZeRO tag)
    # unless --tag names the universal folder.
    assert _inspect(capsys, str(m.root))["format"] == "deepspeed"
    assert _inspect(capsys, str(m.root), "--tag", m.utag)["format"] == "deepspeed-universal"
    # A folder holding only `latest_universal` and the universal folder.
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(m.root / "latest_universal", alone / "latest_universal")
    _copy_universal(m, alone / m.utag)
    report = _inspect(capsys, str(alone))
    assert report["format"] == "deepspeed-universal" and report["tag"] == m.utag

    assert main(["inspect", str(m.universal)]) == 0
    text = capsys.readouterr().out
    assert "(DeepSpeed universal, folder" in text and f"{len(trained)} trained" in text
    assert "exp_avg.pt, exp_avg_sq.pt" in text


def test_cli_convert_runs_the_flow(made, convert, prefect_env, tmp_path: Path) -> None:
    """`zerosafe convert ROOT OUT --tag UNIVERSAL` through the Prefect flow, then `verify`."""
    m = made("z2-bf16-ws2-legacy-tied-frozen")
    out = tmp_path / "out"
    args = [str(m.root), str(out), "--tag", m.utag, "--max-shard-size", str(SMALL_SHARDS)]
    proc = run_zerosafe(prefect_env, "convert", "--json", *args, timeout=600)
    summary = json.loads(proc.stdout)
    assert summary["status"] == "converted" and summary["tasks_executed"]["merge"] > 1
    assert_same_output(_read(out), convert(m.root, max_shard_size=SMALL_SHARDS))
    proc = run_zerosafe(
        prefect_env, "verify", str(out), "--against", str(m.root), "--tag", m.utag, check=False
    )
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout + proc.stderr
