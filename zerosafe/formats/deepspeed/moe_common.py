"""What the MoE readers share (`moe` for ZeRO-1/2, `moe_zero3` for AutoEP ZeRO-3): the layout
types, the metadata keys and the AutoEP placement helpers. See `zerosafe.formats.deepspeed.moe`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zerosafe.errors import CheckpointFormatError, LayoutMismatchError, UnsupportedCheckpointError
from zerosafe.formats.deepspeed.layout import FlatGroup, GroupParam
from zerosafe.formats.torch_pickle import TensorRecord

if TYPE_CHECKING:
    from zerosafe.formats.deepspeed.types import LoadedFile

__all__ = [
    "AUTOEP_LAYERS_KEY",
    "EXPERTS_INFIX",
    "PARTITION_GROUPS_KEY",
    "MoELayer",
    "MoELayout",
    "autoep_entries",
    "autoep_layer_of",
    "dense_group",
    "expert_param",
    "placement_of",
]

EXPERTS_INFIX = ".deepspeed_moe.experts.deepspeed_experts."
"""Between a native MoE layer's module path and an expert's local id."""
PARTITION_GROUPS_KEY = "ds_zero_partition_groups"
AUTOEP_LAYERS_KEY = "ds_autoep_layers"


@dataclass(frozen=True, kw_only=True, slots=True)
class MoELayer:
    """One MoE layer: its experts and which ranks hold them."""

    layer_id: int
    """Its place among the MoE layers (`layer_<L>` in expert file names)."""
    prefix: str
    """The module path of the layer (`blocks.0.moe`, `model.layers.3.mlp`)."""
    num_experts: int
    ep_size: int
    experts_of: tuple[tuple[int, ...], ...]
    """Per expert-parallel rank, the global experts it holds in local order."""
    ranks_of: tuple[tuple[int, ...], ...]
    """Per expert-parallel rank, the ranks of its expert-data-parallel group, in partition order."""


@dataclass(kw_only=True)
class MoELayout:
    """What the MoE layers change in a ZeRO checkpoint, for the reader and `inspect`."""

    kind: str
    """`DeepSpeed-MoE` (native `deepspeed.moe.layer.MoE`) or `AutoEP`."""
    layers: list[MoELayer]
    groups: list[FlatGroup]
    """Every flat group, dense ones included; ZeRO-1/2 partition sizes are not set yet."""
    params: dict[str, tuple[int, ...]]
    """Trained params: output name -> output shape, in flat-group order."""
    expert_groups: list[str]
    """Labels of the optimizer groups (ZeRO-3: sub-groups) that hold expert params."""
    expert_files: list[LoadedFile] = field(default_factory=list)
    frozen: list[tuple[str, int, LoadedFile, TensorRecord]] = field(default_factory=list)
    """Frozen expert params `(output name, writer rank, expert file, tensor)`."""
    copies: dict[str, list[tuple[LoadedFile, TensorRecord, int]]] = field(default_factory=dict)
    """16-bit copies of trained expert params in the expert files: output name ->
    `(file, tensor, element offset in the output tensor)`."""
    expert_order: list[str] = field(default_factory=list)
    """Every expert param's output name in `state_dict()` order (by expert, then as the
    expert module orders its params)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """AutoEP registers its router a second time under the Hugging Face block's name
    (`mlp.gate` -> `mlp.router`): those module keys are aliases."""
    notes: list[str] = field(default_factory=list)


def dense_group(
    layout: MoELayout,
    where: str,
    g: int,
    group: Sequence[tuple[str, tuple[int, ...]]],
    parts: Sequence[tuple[int, int]],
) -> None:
    for name, shape in group:
        if EXPERTS_INFIX in name or autoep_layer_of(layout.layers, name) is not None:
            raise LayoutMismatchError(
                f"{where}: expert param '{name}' is in a param group that is not marked `moe`; "
                "DeepSpeed keeps expert params in their own groups"
            )
        layout.params[name] = shape
    layout.groups.append(
        FlatGroup(
            label=f"param group {g}", parts=tuple(parts),
            params=tuple(GroupParam(name=n, numel=math.prod(s)) for n, s in group),
        )
    )  # fmt: skip


def autoep_layer_of(layers: Sequence[MoELayer], name: str) -> MoELayer | None:
    for layer in layers:
        if name.startswith(layer.prefix + ".experts."):
            return layer
    return None


def expert_param(
    layout: MoELayout,
    layers: Mapping[str, MoELayer],
    where: str,
    name: str,
    shape: tuple[int, ...],
    e: int,
    ep_size: int,
    autoep: bool,
) -> GroupParam:
    """Param `name` (rank 0's local name and shape) as expert-parallel rank `e` holds it."""
    numel = math.prod(shape)
    if not autoep:
        prefix, _, rest = name.partition(EXPERTS_INFIX)
        local_id, _, tail = rest.partition(".")
        native = layers[prefix]
        held = native.experts_of[e]
        if native.ep_size != ep_size or not local_id.isdigit() or int(local_id) >= len(held):
            raise LayoutMismatchError(
                f"{where}: param '{name}' names local expert {local_id} of layer '{prefix}', which "
                f"holds {len(held)} experts per expert-parallel rank"
            )
        out = f"{prefix}{EXPERTS_INFIX}{held[int(local_id)]}.{tail}"
        layout.params[out] = shape
        return GroupParam(name=out, numel=numel)
    layer = autoep_layer_of(list(layers.values()), name)
    if layer is None or layer.ep_size != ep_size:
        raise UnsupportedCheckpointError(
            f"{where}: param '{name}' is in an MoE group but is no AutoEP expert weight of "
            f"`{AUTOEP_LAYERS_KEY}`; this MoE layout is not supported"
        )
    experts = layer.experts_of[e]
    if not shape or shape[0] != len(experts):
        raise LayoutMismatchError(
            f"{where}: AutoEP expert weight '{name}' has shape {list(shape)}, but expert-parallel "
            f"rank {e} holds {len(experts)} experts"
        )
    per = numel // len(experts)
    first = {x: min(r for r, xs in enumerate(layer.experts_of) if x in xs) for x in experts}
    runs = tuple((i * per, x * per, per) for i, x in enumerate(experts) if first[x] == e)
    layout.params[name] = (layer.num_experts, *shape[1:])
    return GroupParam(name=name, numel=numel, runs=runs)


def autoep_entries(f: LoadedFile) -> list[Mapping[str, Any]]:
    entries = f.obj.get(AUTOEP_LAYERS_KEY)
    if not isinstance(entries, (list, tuple)) or not all(isinstance(x, Mapping) for x in entries):
        raise CheckpointFormatError(f"{f.url}: `{AUTOEP_LAYERS_KEY}` is missing or unreadable")
    return list(entries)


def placement_of(
    f: LoadedFile, entry: Mapping[str, Any]
) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """`(num_experts, experts per expert-parallel rank)` from an AutoEP placement descriptor."""
    placement = entry.get("expert_placement")
    where = f"{f.url}: `{AUTOEP_LAYERS_KEY}` entry of '{entry.get('module_path')}'"
    if not isinstance(placement, Mapping) or placement.get("version") != 1:
        raise UnsupportedCheckpointError(
            f"{where}: `expert_placement` {placement!r:.80} is not a version-1 placement "
            "descriptor, the one zerosafe reads"
        )
    num_experts = int(placement.get("num_experts", -1))
    ranks = placement.get("ranks") or []
    by_rank = {int(x.get("rank", -1)): tuple(int(y) for y in x.get("experts", ())) for x in ranks}
    ep_size = int(placement.get("ep_size", -1))
    if sorted(by_rank) != list(range(ep_size)) or set().union(*by_rank.values()) != set(
        range(num_experts)
    ):
        raise LayoutMismatchError(
            f"{where}: the placement does not cover experts and ranks: {placement}"
        )
    return num_experts, tuple(by_rank[e] for e in range(ep_size))
