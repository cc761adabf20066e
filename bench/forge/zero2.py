"""ZeRO-1/2 files: one model-states file with the full 16-bit weights, and per rank an
optimizer-states file with its slice of each optimizer group's flat fp32 partition."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .pickles import (
    G_FRAGMENT,
    G_ZERO_STAGE,
    NewObj,
    Piece,
    Reduce,
    Storage,
    tensor,
    torch_size,
    view_again,
)
from .spec import DS_VERSION, Param, Spec
from .states import (
    adam_state,
    loss_scaler,
    lowp_storage,
    model_states,
    module_dict,
    optim_file,
    param_group_dict,
)


@dataclass(frozen=True)
class GroupLayout:
    """An optimizer group flattened: its params at their flat offsets, `total` elements padded to
    `padded` (a multiple of 2 * world size), `part` elements per rank, `pad` on the last rank."""

    params: Sequence[Param]
    offsets: list[int]
    total: int
    padded: int
    part: int
    pad: int


def zero2_layout(spec: Spec) -> list[GroupLayout]:
    """Per optimizer group: params with their flat offsets, padded size, partition size, padding."""
    out = []
    align = 2 * spec.ws
    for g in spec.groups:
        offsets = []
        total = 0
        for p in g:
            offsets.append(total)
            total += p.numel
        padded = -(-total // align) * align
        part = padded // spec.ws
        pad = padded - total
        if pad >= part:
            raise ValueError(
                f"an optimizer group of {total} elements is too small for world size {spec.ws}: "
                f"its padding ({pad}) would cover the last rank's whole partition ({part})"
            )
        out.append(GroupLayout(g, offsets, total, padded, part, pad))
    return out


def zero2_files(spec: Spec, moments: str) -> list[tuple[str, dict[str, Any]]]:
    layout = zero2_layout(spec)
    files = [_model_file(spec, layout)]
    files += [_optim_file(spec, layout, r, moments) for r in range(spec.ws)]
    return files


def _model_file(spec: Spec, layout: list[GroupLayout]) -> tuple[str, dict[str, Any]]:
    """The model states: the full 16-bit (training dtype) weights, as views into per-group flat
    storages; frozen params each on a storage of their own; aliases as views again."""
    tensors: dict[str, Reduce] = {}
    for lay in layout:
        pieces: list[Piece] = [("vals", p.name, 0, p.numel) for p in lay.params]
        if lay.pad:
            pieces.append(("zeros", None, 0, lay.pad))
        st = lowp_storage(spec, pieces, lay.padded)
        for p, off in zip(lay.params, lay.offsets, strict=True):
            tensors[p.name] = tensor(st, p.shape, off)
    frozen_fragments: OrderedDict[str, Any] = OrderedDict()
    for p in spec.frozen:
        t = tensor(lowp_storage(spec, [("vals", p.name, 0, p.numel)], p.numel), p.shape)
        tensors[p.name] = t
        frozen_fragments[p.name] = view_again(t)
    for alias, target in spec.aliases.items():
        tensors[alias] = view_again(tensors[target])
    param_shapes = [
        OrderedDict((p.name, torch_size(p.shape)) for p in lay.params) for lay in layout
    ]
    module = module_dict(spec, tensors)
    return (
        "mp_rank_00_model_states.pt",
        model_states(spec, module, param_shapes, frozen_fragments, 0),
    )


def _rank_slice(lay: GroupLayout, r: int) -> tuple[list[Piece], OrderedDict[str, Any]]:
    """Rank `r`'s partition of a group: the pieces of the params it holds (zeros past the end),
    and DeepSpeed's param_slice_mappings (where each param's piece starts in the partition)."""
    lo_r, hi_r = r * lay.part, (r + 1) * lay.part
    pieces: list[Piece] = []
    mapping: OrderedDict[str, Any] = OrderedDict()
    for p, off in zip(lay.params, lay.offsets, strict=True):
        lo, hi = max(off, lo_r), min(off + p.numel, hi_r)
        if lo < hi:
            pieces.append(("vals", p.name, lo - off, hi - lo))
            mapping[p.name] = NewObj(G_FRAGMENT, {"numel": hi - lo, "start": lo - lo_r})
    tail = hi_r - max(lay.total, lo_r)
    if tail > 0:
        pieces.append(("zeros", None, 0, tail))
    return pieces, mapping


def _optim_file(
    spec: Spec, layout: list[GroupLayout], r: int, moments: str
) -> tuple[str, dict[str, Any]]:
    state: dict[int, Any] = {}
    partitions = []
    paddings = []
    mappings = []
    for gi, lay in enumerate(layout):
        pieces, mapping = _rank_slice(lay, r)
        pad = lay.pad if r == spec.ws - 1 else 0
        state[gi] = adam_state(spec, lay.part, moments)
        storage = Storage("FloatStorage", lay.part, pieces=pieces)
        partitions.append(tensor(storage, (lay.part - pad,), requires_grad=True))
        paddings.append(pad)
        mappings.append(mapping)
    osd = {
        "loss_scaler": loss_scaler(spec),
        "dynamic_loss_scale": spec.dtype == "fp16",
        "overflow": False,
        "clip_grad": float(spec.ds_config.get("gradient_clipping", 1.0)),
        "base_optimizer_state": {
            "state": state,
            "param_groups": [param_group_dict(spec, gi, [gi]) for gi in range(len(layout))],
        },
        "single_partition_of_fp32_groups": partitions,
        "zero_stage": Reduce(G_ZERO_STAGE, (spec.stage,)),
        "group_paddings": paddings,
        "param_alignment_paddings": [[0] * len(lay.params) for lay in layout],
        "partition_count": [spec.ws] * len(layout),
        "ds_version": DS_VERSION,
        "param_slice_mappings": mappings,
    }
    return optim_file(spec, r, osd)
