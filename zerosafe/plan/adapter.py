"""PEFT adapters out (`--adapter`): a checkpoint of a PEFT LoRA model as the adapter PEFT saves.

A PEFT model trained under DeepSpeed (the HF Trainer wraps the `PeftModel` in the engine)
holds every parameter under the `PeftModel`'s own names:
`base_model.model.<module>.lora_A.<adapter>.weight` for the LoRA matrices (trained),
`base_model.model.<module>.base_layer.weight` for the base weights they adapt (frozen), and
for `modules_to_save` `<module>.modules_to_save.<adapter>.<param>` (the trained copy) beside
`<module>.original_module.<param>` (frozen). `PeftModel.save_pretrained` writes
`adapter_model.safetensors` with `get_peft_model_state_dict`'s names: the `base_model.model.`
prefix kept, the adapter name removed (`...q_proj.lora_A.weight`,
`...lm_head.weight` for a module to save), and only the adapter's tensors, never the base
model's (peft `utils/save_and_load.py`, `tuners/tuners_utils.py`
`_remove_adapter_name_from_state_dict_key`, `utils/other.py` `ModulesToSaveWrapper`):
https://huggingface.co/docs/peft/developer_guides/checkpoint

`adapter_layout` turns a reader's `SourceLayout` into that adapter: the adapter's tensors
under PEFT's names, nothing of the base model, each LoRA matrix checked against the shape
`adapter_config.json` implies (its rank `r`, or `rank_pattern`'s, and the base layer's
features where the checkpoint holds the base weight). A matrix that disagrees is what a
rank-0-only save looks like (the Trainer's own `adapter_model.safetensors` under ZeRO-3 holds
0-element tensors), so it is refused, never written. The tensors themselves are gathered from
every rank by the reader's fragments, as for any conversion.

The config's `target_modules` must name exactly the modules the LoRA tensors adapt, by PEFT's
own matching rule (`LoraTargets`, after peft `tuners/tuners_utils.py`
`check_target_module_exists`): `PeftModel.from_pretrained` puts LoRA layers where the config
says and loads the saved matrices into them without checking, so a module the config leaves
out loses its matrices silently, and one it names beyond them gets an untrained layer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from zerosafe.errors import CheckpointFormatError, ConfigError, LayoutMismatchError
from zerosafe.formats.base import SourceLayout, SourceTensor
from zerosafe.io.storage import Storage, join_url

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "AdapterTensor",
    "LoraTargets",
    "adapter_layout",
    "adapter_names",
    "check_lora_shapes",
    "check_lora_targets",
    "looks_like_adapter",
    "read_adapter_config",
]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What a `PeftModel` puts before the base model's module names (LoRA and the other
non-prompt methods); PEFT's saved names keep it."""
CONFIG_MAX_BYTES = 2**20

# `<module>.<lora_A|lora_B>.<adapter>.<weight|bias>`: a LoRA layer's matrices (nn.Linear/Conv)
_LORA = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.(?P<adapter>[^.]+)\.(?P<leaf>weight|bias)$"
)
# `<module>.<lora_embedding_A|lora_embedding_B>.<adapter>`: an embedding's LoRA (nn.Parameter)
_LORA_EMBEDDING = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_embedding_A|lora_embedding_B)\.(?P<adapter>[^.]+)$"
)
# `<module>.modules_to_save.<adapter>.<param>`: the trained copy of a module to save
_TO_SAVE = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>.+)$")


@dataclass(frozen=True, slots=True)
class AdapterTensor:
    """One checkpoint tensor that belongs to the adapter."""

    name: str
    """The checkpoint's name (the `PeftModel`'s parameter name)."""
    saved_name: str
    """The name `PeftModel.save_pretrained` gives it."""
    module: str
    """The adapted module (`base_model.model.model.layers.0.self_attn.q_proj`)."""
    kind: str
    """`lora_A`, `lora_B`, `lora_embedding_A`, `lora_embedding_B`, `modules_to_save` or `bias`."""
    adapter: str | None
    """The adapter name in the checkpoint's name (`default`); None for a trained bias."""


def adapter_names(name: str, *, bias: str = "none") -> AdapterTensor | None:
    """How PEFT saves checkpoint tensor `name` of a LoRA model, or None if PEFT does not save
    it (a base model weight). `bias` is the config's `bias` (`none`, `all`, `lora_only`):
    a trained bias is saved under its own name.

    >>> adapter_names("base_model.model.m.q_proj.lora_A.default.weight").saved_name
    'base_model.model.m.q_proj.lora_A.weight'
    >>> adapter_names("base_model.model.lm_head.modules_to_save.default.weight").saved_name
    'base_model.model.lm_head.weight'
    """
    m = _LORA.match(name)
    if m:
        saved = f"{m['module']}.{m['kind']}.{m['leaf']}"
        return AdapterTensor(name, saved, m["module"], m["kind"], m["adapter"])
    m = _LORA_EMBEDDING.match(name)
    if m:
        return AdapterTensor(
            name, f"{m['module']}.{m['kind']}", m["module"], m["kind"], m["adapter"]
        )
    m = _TO_SAVE.match(name)
    if m:
        saved = f"{m['module']}.{m['param']}"
        return AdapterTensor(name, saved, m["module"], "modules_to_save", m["adapter"])
    if (bias == "all" and (name == "bias" or name.endswith(".bias"))) or (
        bias == "lora_only" and name.endswith(".base_layer.bias")
    ):
        module = name.removesuffix(".bias").removesuffix(".base_layer")
        return AdapterTensor(name, name, module, "bias", None)
    return None


def read_adapter_config(storage: Storage, folder: str) -> dict[str, Any]:
    """`folder/adapter_config.json`, checked to describe a LoRA adapter zerosafe can write.

    Raises:
        ConfigError: If it is missing.
        CheckpointFormatError: If it is not a JSON object, or is of a PEFT method or LoRA
            variant not supported yet.
    """
    url = join_url(folder, ADAPTER_CONFIG_NAME)
    if not storage.exists(url):
        raise ConfigError(
            f"{url}: missing; `--adapter` copies the adapter_config.json that "
            "`PeftModel.save_pretrained` (the HF Trainer) writes beside the checkpoint's tag "
            "folder. Pass `--model-files DIR` for the folder holding it, or convert without "
            "`--adapter`"
        )
    raw = storage.read_small(url, limit_bytes=CONFIG_MAX_BYTES, what="a PEFT config (JSON)")
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise CheckpointFormatError(f"{url}: not valid JSON ({e}); expected a PEFT config") from e
    if not isinstance(config, dict):
        raise CheckpointFormatError(f"{url}: expected a JSON object (a PEFT config)")
    unsupported = {
        "peft_type": config.get("peft_type") not in ("LORA", None),
        "use_dora": bool(config.get("use_dora")),
        "trainable_token_indices": config.get("trainable_token_indices") is not None,
        "target_parameters": bool(config.get("target_parameters")),
    }
    what = [k for k, bad in unsupported.items() if bad]
    if what or not isinstance(config.get("r"), int):
        found = ", ".join(f"`{k}` {config.get(k)!r}" for k in what) or f"`r` {config.get('r')!r}"
        raise CheckpointFormatError(
            f"{url}: `--adapter` writes plain LoRA adapters (peft_type 'LORA', an integer `r`, "
            f"no DoRA or trainable tokens), found {found}; not supported yet: convert without "
            "`--adapter` for the checkpoint's own names"
        )
    return config


def _bad_field(url: str, key: str, value: Any, allowed: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{url}: `{key}` is {json.dumps(value)}, expected {allowed} (as PEFT's LoraConfig takes "
        "it); correct adapter_config.json"
    )


def _config_names(
    config: dict[str, Any], key: str, url: str, *, string: bool, entries_regex: bool
) -> str | tuple[str, ...]:
    """Config field `key`: a string (a regex, where `string` allows one) or a list of strings
    (regexes too where `entries_regex`), () for null; every regex checked to compile.

    Raises:
        CheckpointFormatError: If it is of another type, or a regex does not compile.
    """
    value = config.get(key)
    if value is None:
        return ()
    names: str | tuple[str, ...]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        regexes, names = (value if entries_regex else []), tuple(value)
    elif string and isinstance(value, str):
        regexes, names = [value], value
    else:
        kinds = "a string (a regex), a list of module names" if string else "a list of names"
        raise _bad_field(url, key, value, f"{kinds} or null")
    for pattern in regexes:
        try:
            re.compile(pattern)
        except re.error as e:
            raise CheckpointFormatError(
                f"{url}: `{key}` '{pattern}' is not a valid regular expression ({e}); PEFT "
                "cannot load this adapter either: correct adapter_config.json"
            ) from e
    return names


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraTargets:
    """The modules PEFT puts a LoRA layer on, as adapter_config.json says, by peft's
    `check_target_module_exists` (`tuners/tuners_utils.py`), on a module's name inside the base
    model (`model.layers.0.self_attn.q_proj`, no `base_model.model.`): a module matched by
    `exclude_modules` (a string: a full-match regex; a list: a name or a `.`-suffix) or by a
    `modules_to_save` entry is never adapted; a string `target_modules` is a full-match regex;
    a list matches a name exactly or as a `.`-suffix, and a suffix match counts only in the
    layers `layers_to_transform` lists (the index after `layers_pattern`, or after the second
    name segment without one).

    >>> t = LoraTargets.from_config({"target_modules": ["q_proj"], "layers_to_transform": 1})
    >>> t.matched_by("model.layers.1.self_attn.q_proj"), t.matched_by("model.layers.0.q_proj")
    (('q_proj',), ())
    """

    target_modules: str | tuple[str, ...] | None
    """The config's `target_modules`; None where it cannot be checked from tensors alone:
    'all-linear' (every linear layer of the base model but the output layer) or null (PEFT's
    default for the base model's architecture)."""
    exclude_modules: str | tuple[str, ...]
    """The config's `exclude_modules` (empty: none)."""
    modules_to_save: tuple[str, ...]
    """The config's `modules_to_save`, which PEFT never adapts with LoRA."""
    layers_to_transform: tuple[int, ...] | None
    """The layer indexes a suffix match must be in; None: every layer."""
    layers_pattern: tuple[str, ...]
    """The regexes of the module list before the layer index (empty: any name)."""

    @classmethod
    def from_config(cls, config: dict[str, Any], *, url: str = ADAPTER_CONFIG_NAME) -> LoraTargets:
        """The targets of a PEFT config (adapter_config.json at `url`, for messages).

        Raises:
            CheckpointFormatError: If a field has a type PEFT does not accept, or a pattern is
                not a valid regex.
        """
        layers = config.get("layers_to_transform")
        layers = [layers] if type(layers) is int else layers
        if not (
            layers is None or (isinstance(layers, list) and all(type(i) is int for i in layers))
        ):
            raise _bad_field(
                url, "layers_to_transform", layers, "an integer, a list of integers or null"
            )
        targets: str | tuple[str, ...] | None = _config_names(
            config, "target_modules", url, string=True, entries_regex=False
        )
        pattern = _config_names(config, "layers_pattern", url, string=True, entries_regex=True)
        if config.get("target_modules") is None or (
            isinstance(targets, str) and targets.lower() == "all-linear"
        ):
            targets = None
        return cls(
            target_modules=targets,
            exclude_modules=_config_names(
                config, "exclude_modules", url, string=True, entries_regex=False
            ),
            modules_to_save=tuple(
                _config_names(config, "modules_to_save", url, string=False, entries_regex=True)
            ),
            layers_to_transform=tuple(layers) if layers else None,
            layers_pattern=(pattern,) if isinstance(pattern, str) and pattern else tuple(pattern),
        )

    def matched_by(self, module: str) -> tuple[str, ...]:
        """The `target_modules` entries that make PEFT adapt `module` (its name inside the base
        model), empty if PEFT does not adapt it; all of `target_modules` for a regex."""
        return self._match(module)[0]

    def why_not(self, module: str) -> str:
        """Why PEFT does not adapt `module`, for a message ('' if it does)."""
        return self._match(module)[1]

    def _match(self, module: str) -> tuple[tuple[str, ...], str]:
        exclude, targets = self.exclude_modules, self.target_modules
        assert targets is not None, "'all-linear' and null targets cannot be matched"
        if (isinstance(exclude, str) and exclude and re.fullmatch(exclude, module)) or (
            isinstance(exclude, tuple) and _listed(module, exclude)
        ):
            return (), f"is excluded by `exclude_modules` {_shown(exclude)}"
        if any(re.match(rf"(^|.*\.){m}($|\..*)", module) for m in self.modules_to_save):
            return (), (
                f"is under `modules_to_save` {_shown(self.modules_to_save)}, which PEFT never "
                "adapts with LoRA"
            )
        if isinstance(targets, str):
            found: tuple[str, ...] = (targets,) if re.fullmatch(targets, module) else ()
        else:
            found = tuple(t for t in targets if _listed(module, (t,)))
            if found and module not in targets and self.layers_to_transform is not None:
                index = self._layer_index(module)
                if index not in self.layers_to_transform:
                    where = "has no layer index" if index is None else f"is in layer {index}"
                    return (), (
                        f"{where}, outside `layers_to_transform` {_shown(self.layers_to_transform)}"
                    )
        return found, "" if found else f"matches no `target_modules` entry {_shown(targets)}"

    def _layer_index(self, module: str) -> int | None:
        """The layer index PEFT reads from `module` (its first numbered segment after a
        `layers_pattern` match, or after the second segment without a pattern)."""
        if not self.layers_pattern:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        else:
            for pattern in self.layers_pattern:
                m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
                if m is not None:
                    break
        return None if m is None else int(m["idx"])


def _listed(module: str, names: tuple[str, ...]) -> bool:
    """PEFT's list rule: `module` is one of `names` or ends with `.<name>`."""
    return module in names or any(module.endswith(f".{n}") for n in names)


def _shown(value: str | tuple[str, ...] | tuple[int, ...]) -> str:
    """A config value as adapter_config.json writes it, for a message."""
    return json.dumps(value if isinstance(value, str) else list(value))


def check_lora_targets(
    adapter: list[AdapterTensor], targets: LoraTargets, *, where: str, url: str
) -> None:
    """Refuse a config (adapter_config.json at `url`) that does not describe the LoRA
    tensors: every LoRA module (of `adapter`, the checkpoint's at `where`) must be one PEFT
    adapts under `targets`, and every `target_modules` entry of a list must match one of them
    (a regex matches them all, or the first rule refuses). 'all-linear' and null
    `target_modules` are not checked: they need the base model.

    Raises:
        CheckpointFormatError: Naming the module or the entry, the config's value, and the fix.
    """
    fix = "correct adapter_config.json to name the modules the run adapted"
    first: dict[str, str] = {}  # LoRA module -> its first tensor, in the checkpoint's order
    for t in adapter:
        if t.kind.startswith("lora_"):
            first.setdefault(t.module, t.name)
    lora = list(first)
    for module in lora if targets.target_modules is not None else []:
        inner = module.removeprefix(PEFT_PREFIX)
        why = targets.why_not(inner)
        if why:
            raise CheckpointFormatError(
                f"{url}: LoRA module '{inner}' {why}, so PeftModel.from_pretrained would "
                f"silently drop its matrices ('{first[module]}' in {where}); {fix}"
            )
    if isinstance(targets.target_modules, tuple):
        used = {e for m in lora for e in targets.matched_by(m.removeprefix(PEFT_PREFIX))}
        for entry in targets.target_modules:
            if entry not in used:
                raise CheckpointFormatError(
                    f"{url}: `target_modules` entry '{entry}' matches no module the LoRA "
                    f"tensors in {where} adapt ({len(lora)} modules, such as "
                    f"'{lora[0].removeprefix(PEFT_PREFIX) if lora else 'none'}'), so the config "
                    f"is not this checkpoint's; {fix} (drop an entry the base model has no "
                    "module for)"
                )


def _rank_of(module: str, config: dict[str, Any]) -> int:
    """The LoRA rank PEFT gives `module`: `rank_pattern`'s first key matching its name (as
    peft's `get_pattern_key` matches, on the name inside the base model), else `r`."""
    inner = module.removeprefix(PEFT_PREFIX)
    for key, rank in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", inner):
            return int(rank)
    return int(config["r"])


def _expected_shape(
    t: AdapterTensor, rank: int, base: tuple[int, ...] | None, *, fan_in_fan_out: bool
) -> tuple[int | None, ...]:
    """The shape `t` must have, None where not known (a LoRA matrix's other side, without
    the base weight in the checkpoint)."""
    out_f: int | None = None
    in_f: int | None = None
    if base is not None and len(base) == 2:
        out_f, in_f = (base[1], base[0]) if fan_in_fan_out else (base[0], base[1])
    if t.kind == "lora_A":
        return (rank, in_f)
    if t.kind == "lora_B":
        return (out_f, rank)
    # nn.Embedding's weight is (num_embeddings, embedding_dim)
    num, dim = (base[0], base[1]) if base is not None and len(base) == 2 else (None, None)
    return (rank, num) if t.kind == "lora_embedding_A" else (dim, rank)


def check_lora_shapes(
    tensors: dict[str, tuple[int, ...]],
    adapter: list[AdapterTensor],
    config: dict[str, Any],
    *,
    where: str,
) -> None:
    """Refuse a LoRA matrix whose shape is not the one the config implies: `lora_A` is
    `(r, in_features)`, `lora_B` `(out_features, r)` (`lora_embedding_A` `(r, num_embeddings)`,
    `lora_embedding_B` `(embedding_dim, r)`), with `r` from the config (`rank_pattern` first)
    and the features from the base layer's weight where `tensors` (name -> shape, of the
    whole checkpoint) holds it; every module with a `lora_A` has its `lora_B`; a module to
    save has the shape of its original module where that is known.

    Raises:
        LayoutMismatchError: Naming the tensor, the shape found and the shape expected.
    """
    fan = bool(config.get("fan_in_fan_out"))
    kinds: dict[str, set[str]] = {}
    for t in adapter:
        shape = tensors[t.name]
        if t.kind == "modules_to_save":
            original = t.name.replace(f".modules_to_save.{t.adapter}.", ".original_module.")
            want: tuple[int | None, ...] | None = tensors.get(original)
        elif t.kind == "bias":
            want = None
        else:
            kinds.setdefault(t.module, set()).add(t.kind.replace("_embedding", ""))
            if t.name.endswith(".bias"):  # lora_bias: lora_B's bias is (out_features,)
                continue
            base = tensors.get(f"{t.module}.base_layer.weight")
            want = _expected_shape(t, _rank_of(t.module, config), base, fan_in_fan_out=fan)
            if len(shape) > 2 and t.kind in ("lora_A", "lora_B"):  # convolutions: (r, in, k...)
                want = (*want, *shape[2:])
        if want is not None and (
            len(shape) != len(want)
            or any(w is not None and s != w for s, w in zip(shape, want, strict=True))
        ):
            shown = "(" + ", ".join("?" if w is None else str(w) for w in want) + ")"
            raise LayoutMismatchError(
                f"{where}: '{t.name}' has shape {tuple(shape)}, expected {shown} (r="
                f"{_rank_of(t.module, config)} from {ADAPTER_CONFIG_NAME}, features from the "
                "base weight); it looks like one rank's slice (a save that did not gather every "
                "rank), so no adapter is written. Convert the checkpoint every rank saved, or "
                f"fix {ADAPTER_CONFIG_NAME} if it is not this model's"
            )
    for module, have in sorted(kinds.items()):
        if have != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - have).pop()
            raise LayoutMismatchError(
                f"{where}: '{module}' has no {missing} beside its "
                f"{have.pop()}; the checkpoint holds half a LoRA layer, so no adapter is written"
            )


def looks_like_adapter(layout: SourceLayout, folder_names: list[str]) -> bool:
    """The rule for saying a checkpoint holds a PEFT adapter (a plan-time warning names
    `--adapter`): `adapter_config.json` in its model-files folder, and every trained
    parameter a LoRA or modules-to-save parameter of one adapter."""
    trained = [n for n, t in layout.tensors.items() if t.role == "param"]
    if ADAPTER_CONFIG_NAME not in folder_names or not trained:
        return False
    found = [adapter_names(n) for n in trained]
    return all(f is not None for f in found) and len({f.adapter for f in found if f}) == 1


def adapter_layout(
    layout: SourceLayout, config: dict[str, Any], *, config_url: str
) -> SourceLayout:
    """`layout` as the adapter PEFT saves: its tensors under PEFT's names, in the checkpoint's
    order, and nothing of the base model.

    Raises:
        CheckpointFormatError: If a trained parameter is not part of the adapter (PEFT would
            drop it), or the checkpoint holds more than one adapter, or none.
        LayoutMismatchError: If a LoRA matrix has another shape than the config implies
            (`check_lora_shapes`).
        CheckpointFormatError: If the config's `target_modules` (or `modules_to_save`) does
            not name the modules the tensors adapt (`check_lora_targets`).
    """
    bias = str(config.get("bias") or "none")
    adapter: list[AdapterTensor] = []
    left_out = 0
    for name, tensor in layout.tensors.items():
        found = adapter_names(name, bias=bias)
        if found is not None and (found.kind != "bias" or tensor.role == "param"):
            adapter.append(found)
        elif tensor.role == "param":
            raise CheckpointFormatError(
                f"{layout.where}: '{name}' is trained but is not part of the adapter "
                f"{config_url} describes (not a LoRA matrix, a `modules_to_save` module or a "
                "bias its `bias` saves), so PEFT's adapter would lose it; add the module to "
                "`modules_to_save`, or convert without `--adapter` for every tensor"
            )
        else:
            left_out += 1
    twice = [t.name for t in adapter if t.kind == "modules_to_save" and t.name.endswith(".bias")]
    if bias == "all" and twice:
        raise CheckpointFormatError(
            f"{layout.where}: `bias` 'all' with `modules_to_save` in {config_url}: PEFT saves "
            f"the trained bias '{twice[0]}' twice (as '<module>.bias' and "
            "'<module>.modules_to_save.bias'); not supported yet: convert without `--adapter`"
        )
    names = {t.adapter for t in adapter if t.adapter is not None}
    if len(names) != 1:
        raise CheckpointFormatError(
            f"{layout.where}: `--adapter` expects the tensors of one PEFT adapter, found "
            f"{'adapters ' + ', '.join(sorted(names)) if names else 'none'}; "
            + ("convert without `--adapter`" if not names else "not supported yet")
        )
    targets = LoraTargets.from_config(config, url=join_url(config_url, ADAPTER_CONFIG_NAME))
    check_lora_targets(
        adapter, targets, where=layout.where, url=join_url(config_url, ADAPTER_CONFIG_NAME)
    )
    shapes = {n: t.shape for n, t in layout.tensors.items()}
    check_lora_shapes(shapes, adapter, config, where=layout.where)
    saved = {t.name: t.saved_name for t in adapter}
    tensors: dict[str, SourceTensor] = {
        saved[n]: replace(layout.tensors[n], name=saved[n]) for n in layout.tensors if n in saved
    }
    order = [saved[n] for n in layout.order if n in saved]
    order += [n for n in tensors if n not in set(order)]
    numel = sum(math.prod(t.shape) for t in tensors.values())
    note = (
        f"PEFT adapter (`--adapter`): {len(tensors)} tensor(s) of adapter '{names.pop()}' "
        f"({numel} elements) under the names PeftModel.save_pretrained gives them, into "
        f"{ADAPTER_WEIGHTS_NAME} with {ADAPTER_CONFIG_NAME}; no base-model tensor is written "
        f"({left_out} in the checkpoint left out): load it with "
        "PeftModel.from_pretrained(base_model, OUT)"
    )
    if targets.target_modules is None:
        note += (
            f"; `target_modules` {config.get('target_modules')!r} is not checked against the "
            "LoRA tensors (PEFT resolves it from the base model when loading)"
        )
    return replace(layout, tensors=tensors, order=order, aliases={}, notes=[*layout.notes, note])
