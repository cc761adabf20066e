"""`--adapter` (issue 26, PEFT adapters out): PEFT's saved names and the LoRA shape checks, on
plain names and shapes, and the names checked against the real `peft` on a tiny model.

The end-to-end test (the HF Trainer under DeepSpeed, `PeftModel.from_pretrained` of the
output) is tests/app/test_peft_adapter.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError, LayoutMismatchError
from zerosafe.formats.base import Slot, SourceDescription, SourceLayout, SourceTensor, StoredDetails
from zerosafe.plan.adapter import (
    ADAPTER_WEIGHTS_NAME,
    LoraTargets,
    adapter_layout,
    adapter_names,
    check_lora_shapes,
    looks_like_adapter,
)
from zerosafe.plan.build import plan_layout

P = "base_model.model.model.layers.0.self_attn"
CONFIG = {"peft_type": "LORA", "r": 4, "bias": "none", "rank_pattern": {}}


@pytest.mark.parametrize(
    ("name", "saved"),
    [
        (f"{P}.q_proj.lora_A.default.weight", f"{P}.q_proj.lora_A.weight"),
        (f"{P}.q_proj.lora_B.default.weight", f"{P}.q_proj.lora_B.weight"),
        (f"{P}.q_proj.lora_B.default.bias", f"{P}.q_proj.lora_B.bias"),  # lora_bias
        # an adapter named like a module keeps the module's name
        ("base_model.model.default.lora_A.default.weight", "base_model.model.default.lora_A.weight"),
        ("base_model.model.embed.lora_embedding_A.default", "base_model.model.embed.lora_embedding_A"),
        ("base_model.model.lm_head.modules_to_save.default.weight", "base_model.model.lm_head.weight"),
        (f"{P}.q_proj.base_layer.weight", None),  # the base model's: never saved
        ("base_model.model.lm_head.original_module.weight", None),
        ("base_model.model.model.norm.weight", None),
        (f"{P}.q_proj.base_layer.bias", None),  # bias "none"
    ],
)  # fmt: skip
def test_peft_saved_names(name: str, saved: str | None) -> None:
    found = adapter_names(name)
    assert (found.saved_name if found else None) == saved


def test_trained_biases_keep_their_names() -> None:
    lora_only = adapter_names(f"{P}.q_proj.base_layer.bias", bias="lora_only")
    assert lora_only is not None and lora_only.saved_name == f"{P}.q_proj.base_layer.bias"
    assert adapter_names("base_model.model.model.norm.bias", bias="lora_only") is None
    every = adapter_names("base_model.model.model.norm.bias", bias="all")
    assert every is not None and every.saved_name == "base_model.model.model.norm.bias"


@pytest.mark.parametrize(
    "options",
    [
        {
            "target_modules": ["embed", "conv", "proj"],
            "bias": "lora_only",
            "modules_to_save": ["head"],
        },
        # lora_bias: no embedding; bias "all": no module to save (refused, see below)
        {"target_modules": ["conv", "proj"], "bias": "all", "lora_bias": True},
    ],
)
def test_names_are_the_ones_peft_itself_saves(options: dict[str, Any]) -> None:
    """Every name the real `get_peft_model_state_dict` returns is `adapter_names` of the
    `PeftModel`'s parameter it comes from: LoRA on linear layers, an embedding and a
    convolution, trained biases (`lora_only`, `all`), `lora_bias`, and a module to save."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(11, 6)
            self.conv = torch.nn.Conv2d(6, 5, 3)
            self.proj = torch.nn.Linear(6, 7)
            self.head = torch.nn.Linear(7, 3)

    model = get_peft_model(Tiny(), LoraConfig(r=2, **options))
    saved = set(get_peft_model_state_dict(model))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    mine = {n: adapter_names(n, bias=options["bias"]) for n, _ in model.named_parameters()}
    assert {m.saved_name for m in mine.values() if m is not None} == saved
    assert {n for n, m in mine.items() if m is not None} == trained
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    check_lora_shapes(
        shapes, [m for m in mine.values() if m is not None], {"r": 2}, where="tiny"
    )  # the real shapes pass, the base weights known


def _shapes(a: tuple[int, ...], b: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    return {
        f"{P}.q_proj.lora_A.default.weight": a,
        f"{P}.q_proj.lora_B.default.weight": b,
        f"{P}.q_proj.base_layer.weight": (12, 24),  # (out_features, in_features)
    }


def _check(shapes: dict[str, tuple[int, ...]], config: dict[str, Any] = CONFIG) -> None:
    found = [adapter_names(n) for n in shapes]
    check_lora_shapes(shapes, [f for f in found if f is not None], config, where="ckpt")


def test_lora_shapes_the_config_implies_pass() -> None:
    _check(_shapes((4, 24), (12, 4)))


@pytest.mark.parametrize(
    ("a", "b", "bad"),
    [
        ((2, 24), (12, 4), "lora_A"),  # rank 0's rows of a row-split lora_A (r 4 on 2 ranks)
        ((4, 24), (6, 4), "lora_B"),  # half of lora_B's out features
        ((48,), (12, 4), "lora_A"),  # a rank's flat ZeRO-3 partition, as a 1-D tensor
        ((0,), (12, 4), "lora_A"),  # the empty placeholder a ZeRO-3 rank holds
        ((4, 12), (12, 4), "lora_A"),  # in features: not the base layer's
    ],
)
def test_a_slice_that_looks_rank_0_only_is_refused(
    a: tuple[int, ...], b: tuple[int, ...], bad: str
) -> None:
    with pytest.raises(LayoutMismatchError, match=rf"\.{bad}\.default\.weight' has shape") as e:
        _check(_shapes(a, b))
    assert "one rank's slice" in str(e.value) and "\n" not in str(e.value)


def test_rank_pattern_and_fan_in_fan_out() -> None:
    # rank_pattern gives q_proj rank 2; GPT-2's Conv1D stores its weight as (in, out)
    config = {**CONFIG, "rank_pattern": {"q_proj": 2}, "fan_in_fan_out": True}
    shapes = _shapes((2, 12), (24, 2))
    shapes[f"{P}.q_proj.base_layer.weight"] = (12, 24)
    _check(shapes, config)
    with pytest.raises(LayoutMismatchError, match=r"expected \(2, 12\)"):
        _check(_shapes((4, 12), (24, 2)), config)


def test_half_a_lora_layer_is_refused() -> None:
    shapes = _shapes((4, 24), (12, 4))
    del shapes[f"{P}.q_proj.lora_B.default.weight"]
    with pytest.raises(LayoutMismatchError, match="no lora_B beside its lora_A"):
        _check(shapes)


def _slot(index: int, numel: int) -> Slot:
    return Slot(
        index=index, file=0, rank=0, kind="fp32", name=f"s{index}", record=f"r{index}",
        record_offset=0, record_size_bytes=4 * numel, record_crc32=0, element_offset=0,
        numel=numel, dtype="float32",
    )  # fmt: skip


def _layout(roles: dict[str, tuple[tuple[int, ...], str]]) -> SourceLayout:
    slots, tensors = [], {}
    for i, (name, (shape, role)) in enumerate(roles.items()):
        numel = 1
        for d in shape:
            numel *= d
        slots.append(_slot(i, numel))
        tensors[name] = SourceTensor(
            name=name, shape=shape, dtype="float32", role=role, fragments=((i, 0, numel, 0),)
        )
    return SourceLayout(
        format="test", where="ckpt", tag="t", files=[], slots=slots, tensors=tensors,
        order=list(tensors),
        source=SourceDescription(
            format="test", checkpoint="ckpt", tag="t", num_params=0, checkpoint_bytes=0,
            files=(), content_sha256="", details=StoredDetails((), ("checkpoint", "tag")),
        ),
    )  # fmt: skip


def test_adapter_layout_keeps_the_adapter_only_under_peft_names() -> None:
    layout = _layout(
        {
            f"{P}.q_proj.base_layer.weight": ((12, 24), "frozen"),
            f"{P}.q_proj.lora_A.default.weight": ((4, 24), "param"),
            f"{P}.q_proj.lora_B.default.weight": ((12, 4), "param"),
            "base_model.model.lm_head.original_module.weight": ((53, 24), "frozen"),
            "base_model.model.lm_head.modules_to_save.default.weight": ((53, 24), "param"),
        }
    )
    config = {**CONFIG, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}
    out = adapter_layout(layout, config, config_url="folder")
    assert list(out.tensors) == out.order == [
        f"{P}.q_proj.lora_A.weight", f"{P}.q_proj.lora_B.weight", "base_model.model.lm_head.weight"
    ]  # fmt: skip
    assert out.tensors["base_model.model.lm_head.weight"].fragments == ((4, 0, 53 * 24, 0),)
    assert any("2 in the checkpoint left out" in n for n in out.notes)
    plan = plan_layout(out, ConvertOptions(adapter=True, max_shard_size=100))
    assert [s.file_name for s in plan.shards] == [ADAPTER_WEIGHTS_NAME]  # never sharded
    assert looks_like_adapter(layout, ["adapter_config.json"])
    assert not looks_like_adapter(layout, ["config.json"])


def test_a_trained_tensor_outside_the_adapter_is_refused() -> None:
    layout = _layout(
        {
            f"{P}.q_proj.lora_A.default.weight": ((4, 24), "param"),
            f"{P}.q_proj.lora_B.default.weight": ((12, 4), "param"),
            "base_model.model.model.norm.weight": ((24,), "param"),  # unfrozen by hand
        }
    )
    with pytest.raises(
        CheckpointFormatError, match="'base_model.model.model.norm.weight' is trained but"
    ):
        adapter_layout(layout, CONFIG, config_url="folder")
    assert not looks_like_adapter(layout, ["adapter_config.json"])


def test_bias_all_with_a_module_to_save_is_refused() -> None:
    """PEFT saves such a module's trained bias twice (`head.bias` and, by the `bias: all` rule,
    `head.modules_to_save.bias`); zerosafe writes a tensor once: not supported yet."""
    layout = _layout(
        {
            f"{P}.q_proj.lora_A.default.weight": ((4, 24), "param"),
            f"{P}.q_proj.lora_B.default.weight": ((12, 4), "param"),
            "base_model.model.lm_head.modules_to_save.default.bias": ((53,), "param"),
        }
    )
    with pytest.raises(CheckpointFormatError, match="`bias` 'all' with `modules_to_save`"):
        adapter_layout(layout, {**CONFIG, "bias": "all"}, config_url="folder")


def test_two_adapters_are_refused() -> None:
    layout = _layout(
        {
            f"{P}.q_proj.lora_A.default.weight": ((4, 24), "param"),
            f"{P}.q_proj.lora_B.default.weight": ((12, 4), "param"),
            f"{P}.q_proj.lora_A.other.weight": ((4, 24), "param"),
            f"{P}.q_proj.lora_B.other.weight": ((12, 4), "param"),
        }
    )
    with pytest.raises(CheckpointFormatError, match="adapters default, other"):
        adapter_layout(layout, CONFIG, config_url="folder")


# Issue 37 item 3: `target_modules` checked against the LoRA tensors, by PEFT's own rule.
Q0, V0, Q1 = (
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.v_proj",
    "model.h.1.q_proj",
)


@pytest.mark.parametrize(
    ("config", "module", "entries"),
    [
        ({"target_modules": ["q_proj"]}, Q0, ("q_proj",)),  # a `.`-suffix
        ({"target_modules": ["proj"]}, Q0, ()),  # not any suffix: a whole name segment
        ({"target_modules": ["self_attn.q_proj", "q_proj"]}, Q0, ("self_attn.q_proj", "q_proj")),
        ({"target_modules": [Q0]}, Q0, (Q0,)),  # the whole name
        ({"target_modules": r".*\.(q|v)_proj"}, V0, (r".*\.(q|v)_proj",)),  # a regex
        ({"target_modules": "q_proj"}, Q0, ()),  # a regex full-matches the whole name
        ({"target_modules": ["q_proj"], "exclude_modules": ["self_attn.q_proj"]}, Q0, ()),
        ({"target_modules": ["q_proj"], "exclude_modules": r".*layers\.0\..*"}, Q0, ()),
        ({"target_modules": ["q_proj"], "exclude_modules": r"layers\.0.*"}, Q0, ("q_proj",)),
        ({"target_modules": ["q_proj"], "modules_to_save": ["self_attn"]}, Q0, ()),
        ({"target_modules": ["q_proj"], "layers_to_transform": 0}, Q0, ("q_proj",)),
        ({"target_modules": ["q_proj"], "layers_to_transform": [1, 2]}, Q0, ()),
        ({"target_modules": ["q_proj"], "layers_to_transform": [1]}, Q1, ("q_proj",)),
        ({"target_modules": ["q_proj"], "layers_to_transform": []}, Q0, ("q_proj",)),  # all
        # the whole name is not restricted by layer (as in peft); a regex never is
        ({"target_modules": [Q0], "layers_to_transform": [1]}, Q0, (Q0,)),
        ({"target_modules": ".*q_proj", "layers_to_transform": [1]}, Q0, (".*q_proj",)),
        # `layers_pattern` names the list before the index
        ({"target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": "h"},
         Q1, ("q_proj",)),
        ({"target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": ["x"]},
         Q1, ()),
    ],
)  # fmt: skip
def test_target_rule_on_plain_names(
    config: dict[str, Any], module: str, entries: tuple[str, ...]
) -> None:
    assert LoraTargets.from_config(config).matched_by(module) == entries


@pytest.mark.parametrize(
    "config",
    [
        {"target_modules": ["q_proj", "v_proj"]},
        {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0, 2]},
        {"target_modules": ["proj"], "layers_to_transform": 1, "layers_pattern": "blocks"},
        {"target_modules": r".*\.(q|v|k)_proj", "exclude_modules": ["k_proj"]},
        {"target_modules": ["q_proj", "head"], "exclude_modules": r".*\.1\..*"},
        {"target_modules": ["q_proj", "v_proj", "proj"], "modules_to_save": ["blocks.2"]},
        {"target_modules": ["model.blocks.0.attn.q_proj", "v_proj"], "layers_to_transform": [2]},
        {
            "target_modules": ["attn.q_proj"],
            "layers_to_transform": [1],
            "layers_pattern": ["x", "blocks"],
        },
    ],
)
def test_target_rule_agrees_with_peft(config: dict[str, Any]) -> None:
    """The modules `LoraTargets` matches are the ones the real `get_peft_model` adapts."""
    import torch
    from peft import LoraConfig, get_peft_model

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(4, 4) for _ in range(3))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()
            self.proj = torch.nn.Linear(4, 4)

    class Body(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    class Tiny(torch.nn.Module):  # model.blocks.<i>.attn.q_proj: peft finds the index so
        def __init__(self) -> None:
            super().__init__()
            self.model = Body()
            self.head = torch.nn.Linear(4, 2)

    model = Tiny()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    peft_model = get_peft_model(model, LoraConfig(r=2, **config))
    adapted = {
        n.removeprefix("base_model.model.").removesuffix(".lora_A")
        for n, _ in peft_model.named_modules()
        if n.endswith(".lora_A")
    }
    targets = LoraTargets.from_config(config)
    assert adapted and {n for n in names if targets.matched_by(n)} == adapted


def _lora_layout(*modules: str) -> SourceLayout:
    roles: dict[str, tuple[tuple[int, ...], str]] = {}
    for module in modules:
        roles[f"base_model.model.{module}.lora_A.default.weight"] = ((4, 24), "param")
        roles[f"base_model.model.{module}.lora_B.default.weight"] = ((12, 4), "param")
    roles["base_model.model.lm_head.modules_to_save.default.weight"] = ((53, 24), "param")
    return _layout(roles)


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        # the config leaves out v_proj: PEFT would load the adapter and drop v_proj's matrices
        ({"target_modules": ["q_proj"]},
         "LoRA module '" + V0 + r"' matches no `target_modules` entry \[\"q_proj\"\]"),
        ({"target_modules": ["q_proj", "v_proj", "qkv"]}, r"entry 'qkv' matches no module"),
        # an entry every module of is excluded is not this checkpoint's either
        ({"target_modules": ["q_proj", "v_proj", "k_proj"], "exclude_modules": ["k_proj"]},
         r"entry 'k_proj' matches no module"),
        ({"target_modules": r".*\.q_proj"}, rf"'{V0}' matches no `target_modules` entry"),
        ({"target_modules": ["q_proj", "v_proj"], "exclude_modules": ["v_proj"]},
         "'" + V0 + r"' is excluded by `exclude_modules` \[.v_proj.\]"),
        ({"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head", "v_proj"]},
         rf"'{V0}' is under `modules_to_save`"),
        ({"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]},
         rf"'{Q0}' is in layer 0, outside `layers_to_transform` \[1\]"),
        ({"target_modules": 7}, r"`target_modules` is 7, expected a string \(a regex\), a list"),
        ({"target_modules": "(q_proj"}, r"`target_modules` '\(q_proj' is not a valid regular"),
        ({"layers_to_transform": ["0"]}, r"`layers_to_transform` is \[.0.\], expected an"),
    ],
)  # fmt: skip
def test_targets_that_disagree_with_the_lora_tensors_are_refused(
    changes: dict[str, Any], refusal: str
) -> None:
    config = {**CONFIG, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]}
    with pytest.raises(CheckpointFormatError, match=refusal) as e:
        adapter_layout(_lora_layout(Q0, V0), {**config, **changes}, config_url="folder")
    assert str(e.value).startswith("folder/adapter_config.json: ")
    assert "correct adapter_config.json" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"target_modules": r"model\.layers\.0\.self_attn\.(q|v)_proj"},
        {"target_modules": ["self_attn.q_proj", "v_proj"], "exclude_modules": r".*\.k_proj"},
        {"layers_to_transform": [0]},
    ],
)
def test_targets_that_match_the_lora_tensors_pass(changes: dict[str, Any]) -> None:
    config = {**CONFIG, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]}
    out = adapter_layout(_lora_layout(Q0, V0), {**config, **changes}, config_url="folder")
    assert len(out.tensors) == 5 and not any("not checked" in n for n in out.notes)


@pytest.mark.parametrize("targets", ["all-linear", "ALL-LINEAR", None])
def test_targets_that_need_the_base_model_pass_with_a_note(targets: str | None) -> None:
    """'all-linear' (and null, PEFT's default for the architecture) are resolved from the base
    model, which a checkpoint does not hold: accepted, and the note says it is not checked."""
    config = {**CONFIG, "target_modules": targets, "modules_to_save": ["lm_head"]}
    out = adapter_layout(_lora_layout(Q0, V0), config, config_url="folder")
    assert any(f"`target_modules` {targets!r} is not checked" in n for n in out.notes)
