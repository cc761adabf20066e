"""Issue 37, item 2: a DCP save without a top-level `model` key, as PyTorch's own recipe writes
it (`dcp.save({"app": AppState(model, optim)})`, keys `app.model.*` and `app.optim.*`), was
converted key by key, the AdamW moments written as if they were trained weights. The default
selection now converts the one subtree named `model` and says so, refuses a save where the
model is ambiguous, and never takes optimizer state for weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.formats.dcp.helpers import same_bits
from tests.formats.dcp.test_convert import convert, load_output, run
from zerosafe.errors import CheckpointFormatError, ConfigError
from zerosafe.formats.dcp.reader import DcpSelection, select_tensors
from zerosafe.formats.optimizer_state import is_optimizer_state

Checkpoint = Callable[[str], Path]


def test_recipe_save_converts_the_model_subtree(
    dcp_checkpoint: Checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = dcp_checkpoint("app"), tmp_path / "out"
    live = load_file(src.parent / "app.live.safetensors")
    summary = convert(capsys, src, out)
    got = load_output(out)
    assert set(got) == set(live) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, ref in live.items():
        assert same_bits(got[name], ref), name
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert not [n for n in manifest["tensors"] if "exp_avg" in n or "optim" in n]
    assert manifest["source"]["select"] == ["app.model"]
    assert manifest["source"]["strip_prefix"] == "app.model"
    assert any(
        "'app.model'" in note and "no top-level `model`" in note for note in summary["notes"]
    )
    code, stdout, err = run(capsys, "verify", str(out), "--against", str(src), "--json")
    assert code == 0, err
    assert json.loads(stdout)["against"]["expected_tensors"] == 4


def test_inspect_counts_only_the_model(
    dcp_checkpoint: Checkpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    code, stdout, err = run(capsys, "inspect", "--json", str(dcp_checkpoint("app")))
    assert code == 0, err
    report = json.loads(stdout)
    assert report["params"]["trained"] == 4
    assert report["params"]["trained_elements"] == 6 * 10 + 10 + 10 * 3 + 3
    assert report["model_subtree"] == "app.model"
    code, text, _ = run(capsys, "inspect", str(dcp_checkpoint("app")))
    assert code == 0 and "4 trained" in text and "'app.model'" in text


def test_two_model_subtrees_are_refused_with_the_choices(
    dcp_checkpoint: Checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = dcp_checkpoint("app_two_models"), tmp_path / "out"
    code, _, err = run(capsys, "convert", str(src), str(out), "--via", "local")
    assert code == 2 and not list(out.glob("*.safetensors"))
    line = err.strip()
    assert "\n" not in line and line.startswith(f"zerosafe: error: {src}: ")
    assert "--select app.model --strip-prefix app.model." in line
    assert "--select ref.model --strip-prefix ref.model." in line
    summary = convert(capsys, src, out, "--select", "ref.model", "--strip-prefix", "ref.model.")
    assert summary["status"] == "converted"
    assert set(load_output(out)) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def _names(keys: list[str], selection: DcpSelection | None = None) -> list[str]:
    return [name for _, name in select_tensors(keys, selection or DcpSelection()).pairs]


OPTIM = ["app.optim.state.w.exp_avg", "app.optim.state.w.exp_avg_sq", "app.optim.state.w.step"]


def test_default_selection_on_plain_keys() -> None:
    # the layouts that converted before keep converting the same way
    assert _names(["model.w", "optim.state.w.exp_avg"]) == ["w"]
    assert _names(["w", "encoder.model.w", "b"]) == ["w", "encoder.model.w", "b"]
    assert _names(["state.w.exp_avg", "state.w.step"]) == ["state.w.exp_avg", "state.w.step"]
    # the model's one subtree, wherever it is, its prefix stripped
    assert _names(["app.model.w", "app.model.model.b", *OPTIM]) == ["w", "model.b"]
    assert _names(["x.y.model.w", "x.rng", "opt.state.w.exp_avg"]) == ["w"]
    # an explicit selection is the user's: optimizer state too (README's `--select optim.state`)
    explicit = DcpSelection(select=("app.optim.state",), strip_prefix="app.optim.state")
    assert _names(["app.model.w", *OPTIM], explicit) == ["w.exp_avg", "w.exp_avg_sq", "w.step"]


def test_default_selection_refuses_what_it_cannot_tell() -> None:
    with pytest.raises(CheckpointFormatError, match=r"2 subtrees named `model`") as e:
        select_tensors(["a.model.w", "b.model.w", *OPTIM], DcpSelection(), where="ck")
    assert "'a.model' (`--select a.model --strip-prefix a.model.`)" in str(e.value)
    with pytest.raises(CheckpointFormatError, match=r"no subtree named `model`") as e:
        select_tensors(["net.w", "net.b", "head", *OPTIM], DcpSelection(), where="ck")
    assert "'net' (`--select net --strip-prefix net.`), 'head' (`--select head`)" in str(e.value)
    assert "app.optim.state.w.exp_avg" in str(e.value)


@pytest.mark.parametrize(
    ("name", "optimizer_state"),
    [
        ("app.optim.state.0.weight.exp_avg", True),
        ("optimizer.state.layers.0.weight.exp_avg_sq", True),
        ("state.emb.weight.step", True),
        ("x.state.emb.weight.max_exp_avg_sq", True),
        ("optim.param_groups.0.lr", True),
        ("opt.param_groups.0.lr", True),
        ("app.model.0.weight", False),
        ("model.layers.0.step", False),
        ("encoder.state_proj.weight", False),
        ("exp_avg", False),
    ],
)
def test_optimizer_state_names(name: str, optimizer_state: bool) -> None:
    assert is_optimizer_state(name) == optimizer_state


def test_an_explicit_select_never_mixes_moments_with_weights() -> None:
    keys = [
        "app.model.0.weight",
        "app.optim.state.0.weight.exp_avg",
        "app.optim.state.0.weight.step",
    ]
    with pytest.raises(ConfigError, match="optimizer state .* together with weights"):
        select_tensors(keys, DcpSelection(select=("app",), strip_prefix="app."))
    # the optimizer state alone stays selectable, as documented (`--select optim.state`)
    picked = select_tensors(keys, DcpSelection(select=("app.optim",), strip_prefix=None))
    assert [fqn for fqn, _ in picked.pairs] == keys[1:]
