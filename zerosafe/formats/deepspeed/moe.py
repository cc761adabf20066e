"""Mixture-of-experts ZeRO checkpoints: expert params partitioned over expert-data-parallel
groups (docs/formats.md, "DeepSpeed-MoE and AutoEP").

DeepSpeed 0.19.8 has two kinds of MoE layer, and `save_checkpoint` (`runtime/engine.py`,
`_save_moe_checkpoint`) writes both the same way at ZeRO-1/2:

- native DeepSpeed-MoE (`deepspeed.moe.layer.MoE(num_experts=E, ep_size=P)`): each
  expert-parallel rank `e` holds `L = E / P` experts as modules
  `<layer>.deepspeed_moe.experts.deepspeed_experts.<i>` (`i` local, `0 <= i < L`); local expert
  `i` of rank `e` is global expert `e * L + i`. A model with `ep_size=1` holds all `E` under
  their global ids, and so does the output. DeepSpeed refuses native MoE at ZeRO-3.
- AutoEP (the `expert_parallel` config) replaces a Hugging Face MoE block by an
  `AutoEPMoELayer` whose experts are fused 3-D weights `<layer>.experts.w1` (`w2`, `w3`) of
  shape `[L, ...]`: rank `e` holds the experts its placement descriptor lists, in that order.
  The output holds each as the logical `[E, ...]` tensor a model with `autoep_size=1` has.

The optimizer (`moe/utils.py`, `split_params_into_different_moe_groups_for_optimizer`) puts
expert params into their own param groups, named `ep_size_<P>` with `moe: True` (in the
saved `base_optimizer_state`), after the dense ones. ZeRO-1/2 (`stage_1_and_2.py`,
`_configure_moe_settings`) partitions such a group over the expert-data-parallel group of
the rank (size `W / P`, its `partition_count`), not over all `W` ranks; each rank's optimizer
file is named by its data-parallel rank as usual. Which ranks form the group comes from
`groups._create_expert_and_data_parallel`: by default rank `r` is expert-parallel rank
`r % P` and the group of `e` is `e, e + P, e + 2P...`; with the config's
`use_data_before_expert_parallelism` it is `r // (W / P)` and the group is
`e * W/P ... (e + 1) * W/P - 1`. Only
data-parallel rank 0 saves the model states, whose `param_shapes` name rank 0's local
experts (expert-parallel rank 0: local ids are global ids), `module` leaves every expert
out, and `num_experts` lists each MoE layer's `E`. Each expert's 16-bit weights are also in
`layer_<L>_expert_<E>_mp_rank_00_model_states.pt` (global ids: `<layer>` counts MoE layers
in `named_modules()` order); zerosafe reads from them only frozen expert params (which have
no master), and samples them against the masters.

AutoEP ZeRO-3 ("partition-native", no expert files, sub-groups partitioned over the ranks
`ds_zero_partition_groups` names) is read by `zerosafe.formats.deepspeed.moe_zero3`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zerosafe.errors import CheckpointFormatError, LayoutMismatchError, UnsupportedCheckpointError
from zerosafe.formats.deepspeed.layout import FlatGroup
from zerosafe.formats.deepspeed.moe_common import (
    AUTOEP_LAYERS_KEY,
    EXPERTS_INFIX,
    PARTITION_GROUPS_KEY,
    MoELayer,
    MoELayout,
    autoep_entries,
    autoep_layer_of,
    dense_group,
    expert_param,
    placement_of,
)
from zerosafe.formats.torch_pickle import TensorRecord

if TYPE_CHECKING:
    from zerosafe.formats.deepspeed.types import LoadedFile

__all__ = [
    "AUTOEP_LAYERS_KEY",
    "EXPERT_FILE_RE",
    "EXPERTS_INFIX",
    "PARTITION_GROUPS_KEY",
    "MoELayer",
    "MoELayout",
    "autoep_aliases",
    "autoep_entries",
    "autoep_layer_of",
    "check_moe_file_name",
    "dense_group",
    "describe_moe",
    "expert_group_ranks",
    "expert_param",
    "placement_of",
    "read_moe_layout",
]

EXPERT_FILE_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_LEGACY_EXPERT_FILE_RE = re.compile(r"^expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPP_OPTIM_RE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_EP_GROUP_RE = re.compile(r"^ep_size_(\d+)$")
_FOLDING_KEY = "autoep_folding"


def check_moe_file_name(tag_url: str, name: str) -> tuple[int, int] | None:
    """`(layer, expert)` of an expert file; None for any other name.

    Raises:
        UnsupportedCheckpointError: For MoE files zerosafe does not read: per-expert-parallel
            optimizer files (MoE trained without ZeRO) and expert files without a layer id.
    """
    if m := _EXPP_OPTIM_RE.match(name):
        raise UnsupportedCheckpointError(
            f"{tag_url}/{name}: an expert-parallel optimizer file, which DeepSpeed writes for MoE "
            "trained without ZeRO (stage 0); it holds no partitioned fp32 master weights. "
            "zerosafe converts ZeRO-1/2/3 checkpoints: load this one with DeepSpeed."
        )
    if _LEGACY_EXPERT_FILE_RE.match(name):
        raise UnsupportedCheckpointError(
            f"{tag_url}/{name}: an expert file without a layer id (the naming of old DeepSpeed "
            "versions, `expert_<E>_mp_rank_00_model_states.pt`), which is not supported; "
            "DeepSpeed 0.19 writes `layer_<L>_expert_<E>_mp_rank_00_model_states.pt`."
        )
    if m := EXPERT_FILE_RE.match(name):
        if int(m.group(3)) != 0:
            raise UnsupportedCheckpointError(
                f"{tag_url}/{name}: expert files of tensor-parallel rank {int(m.group(3))} "
                "(expert tensor parallelism) are not supported; zerosafe converts checkpoints "
                "with model parallel size 1."
            )
        return int(m.group(1)), int(m.group(2))
    return None


def expert_group_ranks(
    world_size: int, ep_size: int, *, data_before_expert: bool
) -> tuple[tuple[int, ...], ...]:
    """Per expert-parallel rank, the ranks of its expert-data-parallel group in group-rank
    order (DeepSpeed `utils/groups.py`, `_create_expert_and_data_parallel`, model parallel
    size 1)."""
    edp = world_size // ep_size
    if data_before_expert:
        return tuple(tuple(range(e * edp, (e + 1) * edp)) for e in range(ep_size))
    return tuple(tuple(range(e, world_size, ep_size)) for e in range(ep_size))


def _file(f: LoadedFile) -> str:
    return f.url.rsplit("/", 1)[-1]


def _base_groups(f: LoadedFile) -> list[Mapping[str, Any]]:
    """The wrapped optimizer's param groups (ZeRO-1/2: `base_optimizer_state`; ZeRO-3:
    `optimizer_state_dict`), without their params."""
    osd = f.obj.get("optimizer_state_dict")
    osd = osd if isinstance(osd, Mapping) else {}
    base = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    groups = base.get("param_groups") if isinstance(base, Mapping) else None
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        raise CheckpointFormatError(
            f"{f.url}: the optimizer's 'param_groups' are missing or unreadable; zerosafe "
            "needs their `name` and `moe` keys to find the expert groups of an MoE checkpoint"
        )
    return list(groups)


def _marked_moe(f: LoadedFile) -> bool:
    """Whether the optimizer's param groups mark one `moe`; False when they are unreadable
    (some optimizers save no `param_groups`, and a checkpoint without MoE needs none)."""
    try:
        return any(g.get("moe") for g in _base_groups(f))
    except CheckpointFormatError:
        return False


def _group_keys(f: LoadedFile) -> list[tuple[str, bool, int]]:
    """`(name, is MoE, occurrence)` of each param group: DeepSpeed orders the expert groups of
    several expert-parallel sizes by iterating a set, so two ranks can order them differently,
    and a group is found by its key, never by its index."""
    seen: Counter[tuple[str, bool]] = Counter()
    keys = []
    for g in _base_groups(f):
        key = (str(g.get("name", "")), bool(g.get("moe", False)))
        keys.append((*key, seen[key]))
        seen[key] += 1
    return keys


def _ep_size_of(name: str, where: str) -> int:
    m = _EP_GROUP_RE.match(name)
    if not m or int(m.group(1)) < 1:
        raise UnsupportedCheckpointError(
            f"{where}: an MoE param group named '{name}'; DeepSpeed names them 'ep_size_<P>' and "
            "zerosafe reads the expert-parallel size from it. A group made another way is not "
            "supported."
        )
    return int(m.group(1))


def _partition_counts(f: LoadedFile) -> list[int]:
    osd = f.obj["optimizer_state_dict"]
    counts = osd.get("partition_count")
    if not isinstance(counts, (list, tuple)) or not all(isinstance(c, int) for c in counts):
        raise CheckpointFormatError(f"{f.url}: unreadable 'partition_count' {counts!r}")
    return list(counts)


def _config(model0: LoadedFile) -> Mapping[str, Any]:
    cfg = model0.obj.get("ds_config")
    return cfg if isinstance(cfg, Mapping) else {}


def _check_no_folding(files: Sequence[LoadedFile]) -> None:
    for f in files:
        if f.obj.get(_FOLDING_KEY) is not None:
            raise UnsupportedCheckpointError(
                f"{f.url}: AutoEP folded with tensor parallelism (`{_FOLDING_KEY}` metadata) is "
                "not supported; zerosafe converts checkpoints with model parallel size 1."
            )


def read_moe_layout(
    *,
    tag_url: str,
    stage: int,
    world_size: int,
    optim_files: Sequence[LoadedFile],
    model_files: Sequence[LoadedFile],
    param_groups: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
    expert_files: Mapping[tuple[int, int], LoadedFile],
) -> MoELayout | None:
    """The MoE layout of a checkpoint, or None when it has no MoE layer.

    Raises:
        UnsupportedCheckpointError: For MoE layouts zerosafe does not convert, by name.
        CheckpointFormatError: For missing expert files or metadata.
        LayoutMismatchError: When files disagree about experts, ranks or partition counts.
    """
    model0 = model_files[0]
    autoep = model0.obj.get(AUTOEP_LAYERS_KEY)
    partition_groups = [
        f.obj["optimizer_state_dict"].get(PARTITION_GROUPS_KEY) for f in optim_files
    ]
    moe_groups = any(_marked_moe(f) for f in optim_files[:1])
    has_moe = (
        "num_experts" in model0.obj or autoep or expert_files or moe_groups
        or any(p is not None for p in partition_groups)
    )  # fmt: skip
    if not has_moe:
        return None
    _check_no_folding([*optim_files, *model_files])
    if stage == 3:
        from zerosafe.formats.deepspeed.moe_zero3 import zero3_autoep_layout

        return zero3_autoep_layout(tag_url, world_size, optim_files, model_files, param_groups)
    if any(p is not None for p in partition_groups):
        f = optim_files[next(i for i, p in enumerate(partition_groups) if p is not None)]
        raise UnsupportedCheckpointError(
            f"{f.url}: `{PARTITION_GROUPS_KEY}` in a ZeRO-{stage} optimizer file; DeepSpeed "
            "writes it only for AutoEP at ZeRO-3, so this layout is not understood"
        )
    if autoep:
        return _zero12(tag_url, world_size, optim_files, model0, param_groups, expert_files, True)
    return _zero12(tag_url, world_size, optim_files, model0, param_groups, expert_files, False)


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2: native DeepSpeed-MoE and AutoEP with per-expert files


def _zero12(
    tag_url: str,
    world_size: int,
    optim_files: Sequence[LoadedFile],
    model0: LoadedFile,
    param_groups: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
    expert_files: Mapping[tuple[int, int], LoadedFile],
    autoep: bool,
) -> MoELayout:
    by_layer = _expert_files_by_layer(tag_url, expert_files, model0)
    data_before = bool(_config(model0).get("use_data_before_expert_parallelism", False))
    keys = [_group_keys(f) for f in optim_files]
    counts = [_partition_counts(f) for f in optim_files]
    index_of = [{k: i for i, k in enumerate(ks)} for ks in keys]
    for f, ks in zip(optim_files, keys, strict=True):
        if sorted(ks) != sorted(keys[0]):
            raise LayoutMismatchError(
                f"{f.url}: its param groups {sorted(k[:2] for k in ks)} are not those of "
                f"{_file(optim_files[0])} ({sorted(k[:2] for k in keys[0])}); files from "
                "different runs are mixed"
            )
    if len(keys[0]) != len(param_groups):
        raise LayoutMismatchError(
            f"{model0.url}: 'param_shapes' has {len(param_groups)} groups but "
            f"{_file(optim_files[0])} has {len(keys[0])} optimizer param groups"
        )
    layers = (
        _autoep_layers(tag_url, model0, world_size, data_before)
        if autoep
        else _native_layers(
            tag_url, by_layer, model0, param_groups, keys[0], world_size, data_before
        )
    )
    layout = MoELayout(
        kind="AutoEP" if autoep else "DeepSpeed-MoE", layers=list(layers.values()), groups=[],
        params={}, expert_groups=[],
        expert_files=[by_layer[L][e] for L in sorted(by_layer) for e in sorted(by_layer[L])],
    )  # fmt: skip
    for g, group in enumerate(param_groups):
        key = keys[0][g]
        where = f"{tag_url}: param group {g} ('{key[0]}')"
        for r, f in enumerate(optim_files):
            want = world_size
            if key[1]:
                want = world_size // _ep_size_of(key[0], where)
            if counts[r][index_of[r][key]] != want:
                what = f"world size {world_size}"
                if key[1]:
                    what += f" over expert-parallel size {world_size // want}"
                raise LayoutMismatchError(
                    f"{f.url}: param group '{key[0]}' is partitioned over "
                    f"{counts[r][index_of[r][key]]} ranks, expected {want} ({what}); files from "
                    "different runs are mixed"
                )
        if not key[1]:
            dense_group(layout, where, g, group, [(r, index_of[r][key]) for r in range(world_size)])
            continue
        layout.expert_groups.append(f"param group {g} ({key[0]})")
        ep_size = _ep_size_of(key[0], where)
        for e in range(ep_size):
            ranks = expert_group_ranks(world_size, ep_size, data_before_expert=data_before)[e]
            params = [
                expert_param(layout, layers, where, name, shape, e, ep_size, autoep)
                for name, shape in group
            ]
            layout.groups.append(
                FlatGroup(
                    label=f"param group {g} ({key[0]}, expert-parallel rank {e})",
                    parts=tuple((r, index_of[r][key]) for r in ranks), params=tuple(params),
                )
            )  # fmt: skip
    _check_expert_files(tag_url, layout, by_layer, autoep)
    if autoep:
        layout.expert_order = [n for n in layout.params if autoep_layer_of(layout.layers, n)]
    return layout


def _expert_files_by_layer(
    tag_url: str, expert_files: Mapping[tuple[int, int], LoadedFile], model0: LoadedFile
) -> dict[int, dict[int, LoadedFile]]:
    """Expert files by layer and expert; every layer needs experts `0..E-1`, `E` as
    `num_experts` lists it."""
    num_experts = model0.obj.get("num_experts")
    by_layer: dict[int, dict[int, LoadedFile]] = {}
    for (layer, expert), f in expert_files.items():
        by_layer.setdefault(layer, {})[expert] = f
    want = list(num_experts) if isinstance(num_experts, (list, tuple)) else None
    if want is None:
        raise CheckpointFormatError(
            f"{model0.url}: MoE files or param groups but no `num_experts` list; DeepSpeed "
            "writes it in every MoE checkpoint's model states"
        )
    for layer, count in enumerate(want):
        have = by_layer.get(layer, {})
        missing = sorted(set(range(int(count))) - set(have))
        if missing:
            raise CheckpointFormatError(
                f"{tag_url}: expert file(s) of MoE layer {layer} missing: "
                f"{', '.join(f'layer_{layer}_expert_{e}_mp_rank_00_model_states.pt' for e in missing[:4])}"
                f"{' ...' if len(missing) > 4 else ''} ({len(missing)} of {count}); copy the whole "
                "tag folder"
            )
    extra = sorted(
        (layer, e) for layer, es in by_layer.items() for e in es
        if layer >= len(want) or e >= int(want[layer])
    )  # fmt: skip
    if extra:
        layer, e = extra[0]
        raise LayoutMismatchError(
            f"{tag_url}: stale expert file layer_{layer}_expert_{e}_mp_rank_00_model_states.pt "
            f"({len(extra)} in all): `num_experts` is {want}, so it comes from another run. Move "
            "it out of the tag folder and run again."
        )
    return by_layer


def _native_layers(
    tag_url: str,
    by_layer: Mapping[int, Mapping[int, LoadedFile]],
    model0: LoadedFile,
    param_groups: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
    keys0: Sequence[tuple[str, bool, int]],
    world_size: int,
    data_before: bool,
) -> dict[str, MoELayer]:
    """Native MoE layers by module path: from the expert files (their keys name the layer) and
    the expert groups' names (their expert-parallel size)."""
    layers: dict[str, MoELayer] = {}
    ep_sizes: dict[str, int] = {}
    for g, group in enumerate(param_groups):
        if not keys0[g][1]:
            continue
        ep_size = _ep_size_of(keys0[g][0], f"{tag_url}: param group {g}")
        for name, _ in group:
            prefix = name.partition(EXPERTS_INFIX)[0]
            if EXPERTS_INFIX not in name:
                raise UnsupportedCheckpointError(
                    f"{model0.url}: param '{name}' is in MoE param group {g} ('{keys0[g][0]}') "
                    "but is not a DeepSpeed-MoE expert "
                    f"(`<layer>{EXPERTS_INFIX}<i>.`); this MoE layout is not supported"
                )
            if ep_sizes.setdefault(prefix, ep_size) != ep_size:
                raise LayoutMismatchError(
                    f"{model0.url}: the experts of '{prefix}' are in groups of expert-parallel "
                    f"sizes {ep_sizes[prefix]} and {ep_size}"
                )
    for layer in sorted(by_layer):
        f = by_layer[layer][0]
        names = [k for k in f.obj if isinstance(k, str)]
        prefixes = {n.partition(EXPERTS_INFIX)[0] for n in names if EXPERTS_INFIX in n}
        if len(prefixes) != 1 or len(names) != sum(EXPERTS_INFIX in n for n in names):
            raise CheckpointFormatError(
                f"{f.url}: expected the weights of one DeepSpeed-MoE expert "
                f"(`<layer>{EXPERTS_INFIX}0.*`), found keys {names[:4]}"
            )
        prefix = prefixes.pop()
        num_experts = len(by_layer[layer])
        size = ep_sizes.get(prefix)
        if size is None:
            raise UnsupportedCheckpointError(
                f"{f.url}: no expert of MoE layer '{prefix}' is trained (none is in an `moe` "
                "param group), so its expert-parallel size is not in the checkpoint; frozen "
                "MoE layers are not supported"
            )
        if num_experts % size or world_size % size:
            raise LayoutMismatchError(
                f"{f.url}: MoE layer '{prefix}' has {num_experts} experts and expert-parallel "
                f"size {size}, with world size {world_size}: neither may leave a remainder"
            )
        local = num_experts // size
        layers[prefix] = MoELayer(
            layer_id=layer, prefix=prefix, num_experts=num_experts, ep_size=size,
            experts_of=tuple(tuple(range(e * local, (e + 1) * local)) for e in range(size)),
            ranks_of=expert_group_ranks(world_size, size, data_before_expert=data_before),
        )  # fmt: skip
    for prefix in ep_sizes:
        if prefix not in layers:
            raise CheckpointFormatError(
                f"{tag_url}: MoE layer '{prefix}' has trained experts but no expert files"
            )
    return layers


def _autoep_layers(
    tag_url: str, model0: LoadedFile, world_size: int, data_before: bool
) -> dict[str, MoELayer]:
    layers: dict[str, MoELayer] = {}
    for entry in autoep_entries(model0):
        fmt = entry.get("checkpoint_format")
        if fmt != "per_expert_files":
            raise UnsupportedCheckpointError(
                f"{model0.url}: AutoEP `checkpoint_format` '{fmt}' in a ZeRO-1/2 checkpoint; "
                "zerosafe reads 'per_expert_files' there"
            )
        num_experts, experts_of = placement_of(model0, entry)
        ep_size = len(experts_of)
        if world_size % ep_size:
            raise LayoutMismatchError(
                f"{model0.url}: AutoEP expert-parallel size {ep_size} does not divide world size "
                f"{world_size}"
            )
        prefix = str(entry.get("module_path"))
        layers[prefix] = MoELayer(
            layer_id=int(entry.get("moe_layer_id", len(layers))), prefix=prefix,
            num_experts=num_experts, ep_size=ep_size, experts_of=experts_of,
            ranks_of=expert_group_ranks(world_size, ep_size, data_before_expert=data_before),
        )  # fmt: skip
    return layers


def _check_expert_files(
    tag_url: str,
    layout: MoELayout,
    by_layer: Mapping[int, Mapping[int, LoadedFile]],
    autoep: bool,
) -> None:
    """Every expert file holds exactly the expert's params with the shapes the masters give
    them: trained ones become 16-bit copies to sample, the rest frozen params (native only)."""
    by_id = {layer.layer_id: layer for layer in layout.layers}
    for layer_id, files in sorted(by_layer.items()):
        layer = by_id.get(layer_id)
        if layer is None:
            raise LayoutMismatchError(
                f"{tag_url}: expert files of MoE layer {layer_id}, which the optimizer groups do "
                "not have"
            )
        for expert, f in sorted(files.items()):
            holder = next(e for e, xs in enumerate(layer.experts_of) if expert in xs)
            writer = layer.ranks_of[holder][0]
            f.rank = writer  # the first rank of the holder's group saved it
            for key, t in f.obj.items():
                if not isinstance(t, TensorRecord):
                    raise CheckpointFormatError(f"{f.url}: entry '{key}' is not a tensor")
                if autoep:
                    _autoep_copy(layout, layer, f, str(key), t, expert)
                    continue
                want = f"{layer.prefix}{EXPERTS_INFIX}{expert}."
                layout.expert_order.append(str(key))
                if not str(key).startswith(want):
                    raise LayoutMismatchError(
                        f"{f.url}: key '{key}' is not a param of expert {expert} of '{layer.prefix}'"
                    )
                shape = layout.params.get(str(key))
                if shape is None:
                    layout.frozen.append((str(key), writer, f, t))
                elif tuple(t.shape) != shape:
                    raise LayoutMismatchError(
                        f"{f.url}: '{key}' has shape {list(t.shape)} but its master has "
                        f"{list(shape)}; the expert files come from another run"
                    )
                else:
                    layout.copies.setdefault(str(key), []).append((f, t, 0))
    if layout.frozen:
        layout.notes.append(
            f"{len(layout.frozen)} frozen expert param(s) taken from the expert files "
            "(`layer_<L>_expert_<E>_mp_rank_00_model_states.pt`, the training dtype; frozen "
            "params have no fp32 master)"
        )


def _autoep_copy(
    layout: MoELayout, layer: MoELayer, f: LoadedFile, key: str, t: TensorRecord, expert: int
) -> None:
    name, _, gid = key.rpartition(".")
    shape = layout.params.get(name)
    if not name.startswith(layer.prefix + ".experts.") or gid != str(expert):
        raise LayoutMismatchError(f"{f.url}: key '{key}' is not a weight of expert {expert}")
    if shape is None:
        raise UnsupportedCheckpointError(
            f"{f.url}: AutoEP expert weight '{name}' is frozen (in no optimizer group); frozen "
            "AutoEP experts are not supported"
        )
    if tuple(t.shape) != shape[1:]:
        raise LayoutMismatchError(
            f"{f.url}: '{key}' has shape {list(t.shape)} but one expert of '{name}' has "
            f"{list(shape[1:])}; the expert files come from another run"
        )
    layout.copies.setdefault(name, []).append((f, t, expert * math.prod(shape[1:])))


# ---------------------------------------------------------------------------------------------


def autoep_aliases(
    layout: MoELayout, module_keys: Sequence[str], known: set[str]
) -> dict[str, str]:
    """Module keys that name an AutoEP router a second time (`<layer>.<hf name>.<rest>` beside
    `<layer>.router.<rest>`): AutoEP registers its router under the Hugging Face block's
    router name too, DeepSpeed records no tie for it, and `state_dict()` holds both."""
    out = {}
    for layer in layout.layers:
        head = layer.prefix + "."
        for key in module_keys:
            if key in known or not key.startswith(head):
                continue
            _, _, rest = key[len(head) :].partition(".")
            target = f"{head}router.{rest}"
            if target in known and target != key:
                out[key] = target
    return out


def describe_moe(layout: MoELayout) -> tuple[str, dict[str, Any]]:
    """`inspect`'s line and JSON block about the MoE layers."""
    kinds: Counter[tuple[int, int, int]] = Counter(
        (x.num_experts, x.ep_size, len(x.ranks_of[0]) if x.ranks_of else 0) for x in layout.layers
    )
    shapes = "; ".join(
        f"{n} layer(s) of {experts} experts, expert-parallel size {ep} (expert params "
        f"partitioned over {edp} rank(s))"
        for (experts, ep, edp), n in kinds.items()
    )
    line = f"  MoE ({layout.kind}): {shapes}; expert groups: {', '.join(layout.expert_groups)}"
    block = {
        "kind": layout.kind,
        "layers": [
            {
                "layer_id": x.layer_id, "module": x.prefix, "num_experts": x.num_experts,
                "ep_size": x.ep_size, "expert_data_parallel_size": len(x.ranks_of[0]) if x.ranks_of else None,
                "experts_by_ep_rank": [list(e) for e in x.experts_of],
                "ranks_by_ep_rank": [list(r) for r in x.ranks_of],
            }
            for x in layout.layers
        ],
        "expert_groups": list(layout.expert_groups),
        "expert_params": len(
            {p.name for g in layout.groups if "expert-parallel" in g.label for p in g.params}
        ),
        "expert_files": len(layout.expert_files),
        "frozen_expert_params": len(layout.frozen),
    }  # fmt: skip
    return line, block
