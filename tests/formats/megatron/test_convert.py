"""megatron-core `torch_dist` saves to Hugging Face Llama weights (issue 40), through the
`zerosafe` command, against the live model's weights mapped with plain torch
(`reference.py`), transformers' own `LlamaForCausalLM`, and `verify --against`."""

from __future__ import annotations

import enum
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.formats.megatron.conftest import live_weights, save_path, saved_args
from tests.formats.megatron.reference import hf_reference
from zerosafe.config import ConvertOptions
from zerosafe.formats.base import SourceDescription
from zerosafe.formats.registry import read_source
from zerosafe.io.storage import Storage
from zerosafe_app.cli import main

ITER = "iter_0000003"


def _convert(capsys: pytest.CaptureFixture[str], src: Path, out: Path, *args: str) -> str:
    code = main(["convert", str(src), str(out), "--via", "local", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def _family(args: dict[str, object]) -> tuple[str, str]:
    """`(architecture, model_type)` of the model the maker built."""
    if args["add_qkv_bias"]:
        return "Qwen2ForCausalLM", "qwen2"
    if args["qk_layernorm"]:
        return "Qwen3ForCausalLM", "qwen3"
    if args.get("num_experts"):
        return "MixtralForCausalLM", "mixtral"
    return "LlamaForCausalLM", "llama"


def _expected_config(args: dict[str, object]) -> dict[str, object]:
    """The architecture fields of the transformers config (`LlamaConfig`, `Qwen2Config`,
    `Qwen3Config`) of the model the maker built."""
    family: dict[str, object] = {
        "llama": {"attention_bias": False, "mlp_bias": False},
        "qwen2": {"use_sliding_window": False},  # q/k/v biases are Qwen2's, always
        "qwen3": {"attention_bias": False, "use_sliding_window": False},
        "mixtral": {"sliding_window": None},
    }[_family(args)[1]]
    if args.get("num_experts"):
        family |= {
            "num_local_experts": args["num_experts"],
            "num_experts_per_tok": args["moe_router_topk"],
        }
    return family | {
        "vocab_size": args["vocab_size"],
        "hidden_size": args["hidden_size"],
        "intermediate_size": args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"],
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": args["num_attention_heads"],
        "num_key_value_heads": args["num_query_groups"],
        "head_dim": args["kv_channels"],
        "hidden_act": "silu",
        "max_position_embeddings": args["max_position_embeddings"],
        "rms_norm_eps": args["norm_epsilon"],
        "tie_word_embeddings": not args["untie_embeddings_and_output_weights"],
    }


def _fused_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral releases' per-expert tensors (`block_sparse_moe.experts.N.w1/w2/w3`,
    `block_sparse_moe.gate`) as transformers 5's `MixtralForCausalLM` parameters: `mlp.gate`,
    `mlp.experts.gate_up_proj` (each expert `[w1; w3]`) and `down_proj` (each `w2`), stacked
    by expert. Other models' weights are returned as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, moe, rest = name.partition(".block_sparse_moe.")
        if not moe:
            out[name] = tensor
        elif rest == "gate.weight":
            experts = sorted(
                {int(k.split(".experts.")[1].split(".")[0]) for k in weights
                 if k.startswith(prefix + moe + "experts.")}
            )  # fmt: skip
            e = prefix + moe + "experts."
            out[prefix + ".mlp.gate.weight"] = tensor
            out[prefix + ".mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([weights[f"{e}{j}.w1.weight"], weights[f"{e}{j}.w3.weight"]])
                 for j in experts]
            )  # fmt: skip
            out[prefix + ".mlp.experts.down_proj"] = torch.stack(
                [weights[f"{e}{j}.w2.weight"] for j in experts]
            )
    return out


def test_converts_bit_equal_and_loads_in_transformers(
    megatron_save: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both layouts (TP=2; TP=1 x DP=2), tied or not, Llama, Qwen2 or Qwen3, give the live
    weights in HF names, bit for bit, a `config.json` that transformers loads, and the same
    logits as a model built from them."""
    import transformers

    out = tmp_path / "out"
    said = _convert(capsys, save_path(megatron_save), out)
    assert "the first 53 of" in said and "config.json generated" in said
    args = saved_args(megatron_save)
    want = hf_reference(live_weights(megatron_save), args)
    got = load_file(str(out / "model.safetensors"))
    assert list(got) == list(want)
    for name, ref in want.items():
        assert got[name].dtype == ref.dtype and torch.equal(got[name], ref), name
    config = json.loads((out / "config.json").read_text())
    expected = _expected_config(args)
    architecture, model_type = _family(args)
    assert (config["architectures"], config["model_type"]) == ([architecture], model_type)
    assert {k: config[k] for k in expected} == expected
    assert config["rope_theta"] == float(str(args["rotary_base"]))

    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(str(out)).eval()
    assert type(model).__name__ == architecture
    for key, value in expected.items():
        assert getattr(model.config, key) == value, key
    assert model.config.rope_parameters["rope_theta"] == float(str(args["rotary_base"]))
    in_model = _fused_experts(want)
    assert set(model.state_dict()) == set(in_model) | {"lm_head.weight"}  # nothing left out
    reference = auto.from_config(transformers.AutoConfig.from_pretrained(str(out))).eval()
    reference.load_state_dict(in_model, strict="lm_head.weight" in want)
    if "lm_head.weight" not in want:  # tied by the config
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 5, 52, 0, 17, 33]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    assert main(["verify", str(out), "--against", str(save_path(megatron_save))]) == 0
    assert capsys.readouterr().out.startswith("OK")


def test_the_save_folder_an_iteration_and_tag_read_alike() -> None:
    """`SAVE` (via `latest_checkpointed_iteration.txt`), `SAVE/iter_N` and `SAVE --tag iter_N`
    read the same save."""
    storage, options = Storage(), ConvertOptions()
    save = str(save_path("tp2"))
    layouts = [
        read_source(storage, save, tag=None, options=options),
        read_source(storage, f"{save}/{ITER}", tag=None, options=options),
        read_source(storage, save, tag=ITER, options=options),
    ]
    first = layouts[0]
    assert first.format == "megatron" and first.tag == ITER
    assert first.source.model_config is not None
    # the generated config travels with the plan (the flow's tasks read it back from JSON)
    again = SourceDescription.from_json(first.source.to_json(), first.source.reader_json())
    assert again.model_config == first.source.model_config
    for layout in layouts[1:]:
        assert layout.tag == ITER and layout.order == first.order
        assert {n: t.fragments for n, t in layout.tensors.items()} == {
            n: t.fragments for n, t in first.tensors.items()
        }
    # optimizer buffers and non-tensor items are listed, never weights
    facts = first.facts.to_json() if first.facts else {}
    assert len(facts["optimizer_buffers"]) == 6  # type: ignore[arg-type]
    assert any(k.startswith("common_state") for k in facts["non_tensor_items"])  # type: ignore[union-attr]
    assert not any(n.startswith("optimizer") for n in first.order)


class AttnBackend(enum.Enum):
    """Stands in for megatron-core's enum of that name (same module, name and values), so the
    fixture's args can be unpickled and pickled again here, where megatron-core is not
    installed; zerosafe reads it as an inert record."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


def _with_megatron_enums(monkeypatch: pytest.MonkeyPatch) -> None:
    module = "megatron.core.transformer.enums"
    AttnBackend.__module__ = module
    for depth in range(1, 5):
        name = ".".join(module.split(".")[:depth])
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(sys.modules[module], "AttnBackend", AttnBackend, raising=False)


def _tampered(tmp_path: Path, name: str, **changes: object) -> Path:
    """A copy of a committed save whose `common_state` args have `changes`: the new
    `torch.save` bytes appended to its `.distcp` file, and `.metadata` pointed at them
    (with `_with_megatron_enums` in force)."""
    import io
    import pickle

    src = save_path(name)
    dst = tmp_path / name
    shutil.copytree(src, dst)
    meta_path = dst / ITER / ".metadata"
    meta = pickle.loads(meta_path.read_bytes())  # the committed fixture: trusted
    key = next(k for k in meta.storage_data if k.fqn.startswith("common_state"))
    info = meta.storage_data[key]
    distcp = dst / ITER / info.relative_path
    data = distcp.read_bytes()
    common = torch.load(
        io.BytesIO(data[info.offset : info.offset + info.length]), weights_only=False
    )
    for field, value in changes.items():
        setattr(common[0]["args"], field, value)
    buf = io.BytesIO()
    torch.save(common, buf)
    distcp.write_bytes(data + buf.getvalue())
    info.offset, info.length = len(data), len(buf.getvalue())
    meta_path.write_bytes(pickle.dumps(meta))
    return dst


def _refusal(capsys: pytest.CaptureFixture[str], src: Path, out: Path) -> str:
    code = main(["convert", str(src), str(out), "--via", "local"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert not out.exists() or not (out / "model.safetensors").exists()
    return lines[0]


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"num_query_groups": 1}, "the args are not this model's"),
        ({"ffn_hidden_size": 24}, "give [2, 48, 32]"),
        ({"qk_layernorm": True}, "no tensor for ['q_norm', 'k_norm']"),
        ({"add_qkv_bias": True}, "no tensor for ['qkv_bias']"),
        (
            {"qk_layernorm": True, "add_qkv_bias": True},
            "QKV biases with query/key norms (neither Qwen2 nor Qwen3)",
        ),
        ({"num_experts": 8}, "no tensor for ['router', 'experts_fc1', 'experts_fc2']"),
        ({"normalization": "LayerNorm"}, "normalization='LayerNorm': not the Llama family"),
        ({"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size=2"),
    ],
)
def test_args_that_do_not_map_are_refused_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    changes: dict[str, object],
    said: str,
) -> None:
    _with_megatron_enums(monkeypatch)
    src = _tampered(tmp_path, "tp2", **changes)
    line = _refusal(capsys, src, tmp_path / "out")
    assert said in line, line
    assert "__0_0.distcp" in line or ITER in line, line


@pytest.mark.parametrize(
    ("name", "changes", "said"),
    [
        ("qwen2tp2", {"add_qkv_bias": False}, "'decoder.layers.self_attention.linear_qkv.bias'"),
        ("qwen3tp2", {"qk_layernorm": False}, "q_layernorm.weight' (2 tensor(s)"),
        ("qwen3tp2", {"kv_channels": 8}, "the args are not this model's"),
        ("moetp2ep2", {"num_experts": None}, "no tensor for ['fc1', 'fc2']"),
        ("moetp2ep2", {"num_experts": 8}, "give [2, 8, 32]"),
        ("moetp2ep2", {"moe_shared_expert_intermediate_size": 64}, "shared experts"),
        ("moetp2ep2", {"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True"),
        ("moetp2ep2", {"moe_grouped_gemm": True}, "moe_grouped_gemm=True: grouped-GEMM experts"),
        ("moetp2ep2", {"moe_layer_freq": 2}, "dense layers between the MoE ones"),
        ("moetp2ep2", {"qk_layernorm": True}, "Qwen3-MoE-style"),
    ],
)
def test_qwen_and_moe_saves_the_mapping_does_not_cover_are_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    changes: dict[str, object],
    said: str,
) -> None:
    """A bias, norm or router the args do not announce is never dropped, and an MoE that is
    not Mixtral's (shared experts, other routing, dense layers between) is not written under
    Mixtral's names: the save is refused in one line."""
    _with_megatron_enums(monkeypatch)
    line = _refusal(capsys, _tampered(tmp_path, name, **changes), tmp_path / "out")
    assert said in line, line


def _model_files(tmp_path: Path, name: str, **changes: object) -> Path:
    """A `--model-files` folder with the transformers config of the save's model (as the
    generated one, plus what a Hugging Face release adds), with `changes` (None: the field
    left out, as transformers' default)."""
    folder = tmp_path / "model-files"
    folder.mkdir()
    from zerosafe.formats.registry import read_source

    layout = read_source(Storage(), str(save_path(name)), tag=None, options=ConvertOptions())
    config = dict(layout.source.model_config or {}) | {"bos_token_id": 7} | changes
    config = {k: v for k, v in config.items() if v is not None}  # None: left out
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_model_files_config_is_used_where_it_agrees_with_the_args(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A release config with the same architecture is copied instead of the generated one;
    `rope_parameters` (transformers 5) counts as `rope_theta`."""
    folder = _model_files(tmp_path, "qwen2tp2", rope_theta=None,
                          rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})  # fmt: skip
    out = tmp_path / "out"
    said = _convert(capsys, save_path("qwen2tp2"), out, "--model-files", str(folder))
    assert "used, not the config generated from the checkpoint" in said
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == 7


@pytest.mark.parametrize(
    ("name", "changes", "said"),
    [
        ("tp2", {"num_hidden_layers": 3}, "`num_hidden_layers` is 3, but the checkpoint gives 2"),
        (
            "tp2",
            {"rope_theta": 500000.0},
            "`rope_theta` is 500000.0, but the checkpoint gives 10000.0",
        ),
        ("tp2", {"tie_word_embeddings": True}, "`tie_word_embeddings` is True"),
        ("tp2", {"vocab_size": 256}, "`vocab_size` is 256, but the checkpoint gives 53"),
        ("qwen2tp2", {"model_type": "llama"}, "`qkv_bias` is False, but the checkpoint gives True"),
        ("qwen3tp2", {"head_dim": None}, "`head_dim` is 8, but the checkpoint gives 16"),
        ("qwen3tp2", {"model_type": "qwen2"}, "`qkv_bias` is True"),
    ],
)
def test_model_files_config_of_another_model_is_refused_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    changes: dict[str, object],
    said: str,
) -> None:
    folder = _model_files(tmp_path, name, **changes)
    out = tmp_path / "out"
    code = main(["convert", str(save_path(name)), str(out), "--via", "local",
                 "--model-files", str(folder)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and said in lines[0], err
    assert "config.json" in lines[0] and "Pass `--model-files DIR`" in lines[0]
    assert not (out / "model.safetensors").exists()
