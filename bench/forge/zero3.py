"""ZeRO-3 files: per rank a model-states file (empty param placeholders, frozen params' fragments)
and an optimizer-states file with the rank's fp32 flat sub-groups."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from .pickles import G_ZERO_STAGE, Piece, Reduce, Storage, tensor, torch_size, view_again
from .spec import Param, Spec
from .states import (
    adam_state,
    loss_scaler,
    lowp_storage,
    model_states,
    module_dict,
    optim_file,
    param_group_dict,
)


def z3_pieces(p: Param, r: int, ws: int) -> list[Piece]:
    """Rank `r`'s piece of param `p`: ceil(numel / ws) elements, zeros past the param's end."""
    c = -(-p.numel // ws)
    lo, hi = min(p.numel, r * c), min(p.numel, (r + 1) * c)
    pieces: list[Piece] = []
    if hi > lo:
        pieces.append(("vals", p.name, lo, hi - lo))
    if c - (hi - lo):
        pieces.append(("zeros", None, 0, c - (hi - lo)))
    return pieces


def zero3_files(spec: Spec, moments: str) -> list[tuple[str, dict[str, Any]]]:
    # one list of (name, shape) per sub-group, shared by every rank's file
    param_shapes_proto = [[(p.name, p.shape) for p in sg] for sg in spec.sub_groups]
    files = [_model_file(spec, r, param_shapes_proto) for r in range(spec.ws)]
    files += [_optim_file(spec, r, moments) for r in range(spec.ws)]
    return files


def _model_file(
    spec: Spec, r: int, param_shapes_proto: Sequence[Sequence[tuple[str, tuple[int, ...]]]]
) -> tuple[str, dict[str, Any]]:
    tensors: dict[str, Reduce] = {}
    for p in spec.params:
        tensors[p.name] = tensor(Storage(spec.lowp_cls, 0, pieces=[]), (0,))
    for alias, target in spec.aliases.items():
        tensors[alias] = view_again(tensors[target])
    frozen_fragments: OrderedDict[str, Any] = OrderedDict()
    for p in spec.frozen:
        c = -(-p.numel // spec.ws)
        frozen_fragments[p.name] = tensor(lowp_storage(spec, z3_pieces(p, r, spec.ws), c), (c,))
    param_shapes = [OrderedDict((n, torch_size(s)) for n, s in sg) for sg in param_shapes_proto]
    module = module_dict(spec, tensors)
    return (
        f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
        model_states(spec, module, param_shapes, frozen_fragments, r),
    )


def _optim_file(spec: Spec, r: int, moments: str) -> tuple[str, dict[str, Any]]:
    state: dict[int, Any] = {}
    flat = []
    for si, sg in enumerate(spec.sub_groups):
        pieces = [pc for p in sg for pc in z3_pieces(p, r, spec.ws)]
        numel = sum(-(-p.numel // spec.ws) for p in sg)
        state[si] = adam_state(spec, numel, moments)
        storage = Storage("FloatStorage", numel, pieces=pieces)
        ds_id = f"{sg[0].index}_{sg[-1].index}"
        flat.append(tensor(storage, (numel,), requires_grad=True, ds_id=ds_id))
    groups = [
        [si for si, owner in enumerate(spec.sub_group_owner) if owner == gi]
        for gi in range(len(spec.groups))
    ]
    osd = {
        "zero_stage": Reduce(G_ZERO_STAGE, (3,)),
        "loss_scaler": loss_scaler(spec),
        "dynamic_loss_scale": spec.dtype == "fp16",
        "overflow": False,
        "partition_count": spec.ws,
        "optimizer_state_dict": {
            "state": state,
            "param_groups": [param_group_dict(spec, gi, g) for gi, g in enumerate(groups)],
        },
        "fp32_flat_groups": flat,
    }
    return optim_file(spec, r, osd)
