"""AutoEP ZeRO-3 "partition-native" checkpoints (docs/formats.md, "DeepSpeed-MoE and AutoEP").

DeepSpeed 0.19.8 saves AutoEP (`expert_parallel` config) at ZeRO-3 without expert files
(`_save_moe_checkpoint`, `checkpoint_format: zero3_partitioned`, version 1): the experts'
masters are in the optimizer files like every other param's, but each flat sub-group is
partitioned over its own ranks. Every optimizer file says which, in
`optimizer_state_dict.ds_zero_partition_groups` (`stage3.py`, `_zero3_partition_group_metadata`):
per sub-group, in `fp32_flat_groups` order, its `partition_count`, this rank's
`partition_rank`, `partition_ranks` (the global ranks holding the sub-group, in partition
order), `families` (`replicated` or `autoep_expert`) and `group_names` (`ep_size_<P>`). Every
rank's model states hold `ds_autoep_layers`: its own `ep_rank` and each layer's placement.
Each sub-group is laid out the ZeRO-3 way over its own partition count: `ceil(numel / count)`
elements of each param per rank, end to end. DeepSpeed's own `zero_to_fp32` refuses these
checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zerosafe.errors import CheckpointFormatError, LayoutMismatchError, UnsupportedCheckpointError
from zerosafe.formats.deepspeed.layout import FlatGroup
from zerosafe.formats.deepspeed.moe_common import (
    AUTOEP_LAYERS_KEY,
    PARTITION_GROUPS_KEY,
    MoELayer,
    MoELayout,
    autoep_entries,
    autoep_layer_of,
    dense_group,
    expert_param,
    placement_of,
)

if TYPE_CHECKING:
    from zerosafe.formats.deepspeed.types import LoadedFile

__all__ = ["zero3_autoep_layout"]

_ZERO3_FORMAT = ("zero3_partitioned", 1)
"""The AutoEP ZeRO-3 `checkpoint_format` and `checkpoint_format_version` zerosafe reads."""


def _file(f: LoadedFile) -> str:
    return f.url.rsplit("/", 1)[-1]


def zero3_autoep_layout(
    tag_url: str,
    world_size: int,
    optim_files: Sequence[LoadedFile],
    model_files: Sequence[LoadedFile],
    param_groups: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
) -> MoELayout:
    """AutoEP ZeRO-3: sub-groups and their partition ranks from `ds_zero_partition_groups`,
    each rank's expert-parallel rank and the placement from its `ds_autoep_layers`."""
    layers, ep_rank_of = _layers_and_ep_ranks(model_files)
    meta = [_partition_groups(f, len(param_groups)) for f in optim_files]
    layout = MoELayout(
        kind="AutoEP", layers=list(layers.values()), groups=[], params={}, expert_groups=[]
    )
    ranks_by_ep: dict[int, tuple[int, ...]] = {}
    for i, group in enumerate(param_groups):
        entry = meta[0][i]
        families = entry.get("families")
        where = f"{optim_files[0].url}: `{PARTITION_GROUPS_KEY}` sub-group {i}"
        for f, m in zip(optim_files, meta, strict=True):
            if (m[i].get("families"), m[i].get("group_names")) != (
                families,
                entry.get("group_names"),
            ):
                raise LayoutMismatchError(
                    f"{f.url}: `{PARTITION_GROUPS_KEY}` sub-group {i} is "
                    f"{m[i].get('families')} but {_file(optim_files[0])} says {families}; files "
                    "from different runs are mixed"
                )
        if families == ["replicated"]:
            ranks = _partition_ranks(optim_files, meta, i, 0)
            if ranks != tuple(range(world_size)):
                raise LayoutMismatchError(
                    f"{where}: a replicated sub-group held by ranks {list(ranks)}"
                )
            dense_group(layout, where, i, group, [(r, i) for r in ranks])
            continue
        if families != ["autoep_expert"]:
            raise UnsupportedCheckpointError(
                f"{where}: families {families!r}; zerosafe reads sub-groups of 'replicated' or "
                "of 'autoep_expert' params"
            )
        layout.expert_groups.append(f"sub-group {i} ({', '.join(entry.get('group_names') or ())})")
        ep_size = {layers[p].ep_size for p in layers}.pop()
        for e in range(ep_size):
            first = next((r for r, x in sorted(ep_rank_of.items()) if x == e), None)
            if first is None:
                raise LayoutMismatchError(f"{tag_url}: no rank file of expert-parallel rank {e}")
            ranks = _partition_ranks(optim_files, meta, i, first)
            if any(ep_rank_of.get(r) != e for r in ranks):
                raise LayoutMismatchError(
                    f"{where}: expert-parallel rank {e}'s partition ranks {list(ranks)} include "
                    "ranks of another expert-parallel rank"
                )
            ranks_by_ep.setdefault(e, ranks)
            params = [expert_param(layout, layers, where, n, s, e, ep_size, True) for n, s in group]
            layout.groups.append(
                FlatGroup(
                    label=f"sub-group {i} (expert-parallel rank {e})",
                    parts=tuple((r, i) for r in ranks), params=tuple(params),
                )
            )  # fmt: skip
    layout.expert_order = [n for n in layout.params if autoep_layer_of(layout.layers, n)]
    layout.layers = [
        MoELayer(
            layer_id=x.layer_id, prefix=x.prefix, num_experts=x.num_experts, ep_size=x.ep_size,
            experts_of=x.experts_of,
            ranks_of=tuple(ranks_by_ep.get(e, ()) for e in range(x.ep_size)),
        )
        for x in layers.values()
    ]  # fmt: skip
    return layout


def _layers_and_ep_ranks(
    model_files: Sequence[LoadedFile],
) -> tuple[dict[str, MoELayer], dict[int, int]]:
    """The AutoEP layers by module path (from rank 0's `ds_autoep_layers`, no partition ranks
    yet) and each rank's expert-parallel rank."""
    for f in model_files:
        if not f.obj.get(AUTOEP_LAYERS_KEY):
            raise UnsupportedCheckpointError(
                f"{f.url}: a ZeRO-3 MoE checkpoint without `{AUTOEP_LAYERS_KEY}`; zerosafe "
                "converts AutoEP's partition-native ZeRO-3 checkpoints only (DeepSpeed refuses "
                "native DeepSpeed-MoE at ZeRO-3)"
            )
    entries0 = autoep_entries(model_files[0])
    layers: dict[str, MoELayer] = {}
    ep_rank_of: dict[int, int] = {}
    for entry in entries0:
        fmt = (entry.get("checkpoint_format"), entry.get("checkpoint_format_version"))
        if fmt != _ZERO3_FORMAT:
            raise UnsupportedCheckpointError(
                f"{model_files[0].url}: AutoEP `checkpoint_format` {fmt[0]!r} version "
                f"{fmt[1]!r} at ZeRO-3; zerosafe reads {_ZERO3_FORMAT[0]!r} version "
                f"{_ZERO3_FORMAT[1]} (DeepSpeed 0.19)"
            )
        num_experts, experts_of = placement_of(model_files[0], entry)
        prefix = str(entry.get("module_path"))
        layers[prefix] = MoELayer(
            layer_id=int(entry.get("moe_layer_id", len(layers))), prefix=prefix,
            num_experts=num_experts, ep_size=len(experts_of), experts_of=experts_of, ranks_of=(),
        )  # fmt: skip
    for f in model_files:
        own = {int(x.get("ep_rank", -1)) for x in autoep_entries(f)}
        if len(own) != 1:
            raise LayoutMismatchError(
                f"{f.url}: its AutoEP layers disagree on its expert-parallel rank"
            )
        ep_rank_of[f.rank] = own.pop()
    return layers, ep_rank_of


def _partition_groups(f: LoadedFile, num_groups: int) -> list[Mapping[str, Any]]:
    raw = f.obj["optimizer_state_dict"].get(PARTITION_GROUPS_KEY)
    if (
        not isinstance(raw, (list, tuple))
        or len(raw) != num_groups
        or not all(isinstance(x, Mapping) and x.get("sub_group") == i for i, x in enumerate(raw))
    ):
        raise CheckpointFormatError(
            f"{f.url}: `{PARTITION_GROUPS_KEY}` must list the {num_groups} sub-groups of "
            f"'param_shapes' in order, found {raw!r:.120}"
        )
    return list(raw)


def _partition_ranks(
    optim_files: Sequence[LoadedFile],
    meta: Sequence[Sequence[Mapping[str, Any]]],
    i: int,
    rank: int,
) -> tuple[int, ...]:
    """The ranks holding sub-group `i` with `rank`, in partition order; every one of them must
    say the same and give its own place in it."""
    ranks = tuple(int(r) for r in meta[rank][i].get("partition_ranks") or ())
    for place, r in enumerate(ranks):
        m = meta[r][i] if 0 <= r < len(meta) else {}
        if (
            tuple(m.get("partition_ranks") or ()) != ranks
            or m.get("partition_rank") != place
            or m.get("partition_count") != len(ranks)
        ):
            raise LayoutMismatchError(
                f"{optim_files[rank].url}: `{PARTITION_GROUPS_KEY}` sub-group {i} is held by "
                f"ranks {list(ranks)}, but rank {r}'s file does not agree ({dict(m)!r:.160})"
            )
    if not ranks:
        raise CheckpointFormatError(
            f"{optim_files[rank].url}: `{PARTITION_GROUPS_KEY}` sub-group {i} has no partition ranks"
        )
    return ranks
