"""The module side of a ZeRO checkpoint, from rank 0's model states: buffers, frozen params,
tied aliases and the output order (`read_module_side`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from zerosafe.errors import CheckpointFormatError, LayoutMismatchError, UnsupportedCheckpointError
from zerosafe.formats.deepspeed.moe import autoep_aliases
from zerosafe.formats.deepspeed.moe_common import EXPERTS_INFIX, MoELayout, autoep_layer_of
from zerosafe.formats.deepspeed.types import FrozenParam, ZeroCheckpoint
from zerosafe.formats.torch_zip import TensorRecord

__all__ = ["read_module_side"]


def read_module_side(ckpt: ZeroCheckpoint) -> None:
    """Buffers, frozen params, tied aliases and the output order, from the model states."""
    model0 = ckpt.model_files[0]
    obj = model0.obj
    module = obj.get("module")
    module = module if isinstance(module, Mapping) else {}
    ckpt.module_order = [k for k in module if isinstance(k, str)]
    shared = _real_ties(ckpt, obj, module)
    if ckpt.moe is not None:
        ckpt.module_order = _with_experts(ckpt.module_order, ckpt.moe)
        known = set(ckpt.param_names) | set(obj.get("buffer_names") or ()) | set(shared)
        ckpt.moe.aliases = autoep_aliases(ckpt.moe, ckpt.module_order, known)
        if ckpt.moe.aliases:
            ckpt.notes.append(
                f"{len(ckpt.moe.aliases)} module key(s) name an AutoEP router a second time "
                "(AutoEP registers it under the Hugging Face block's name too; DeepSpeed records "
                "no tie): written as tied aliases: "
                + ", ".join(f"{a} -> {t}" for a, t in list(ckpt.moe.aliases.items())[:4])
                + (" ..." if len(ckpt.moe.aliases) > 4 else "")
            )
        shared = {**shared, **ckpt.moe.aliases}
    for alias, target in shared.items():
        seen = {alias}
        while target in shared and target not in seen:  # resolve alias chains to the owner
            seen.add(target)
            target = shared[target]
        ckpt.shared[str(alias)] = str(target)
    if ckpt.pipeline_stage is not None:
        return  # `module` is None: buffers and frozen params are in the layer files
    buffer_names = obj.get("buffer_names") or []
    for name in buffer_names:
        t = module.get(name)
        if isinstance(t, TensorRecord):
            ckpt.buffers.append((name, t))
        else:
            ckpt.notes.append(
                f"buffer '{name}' is not in the saved module (non-persistent); not converted"
            )
    frozen_shapes = obj.get("frozen_param_shapes")
    if isinstance(frozen_shapes, Mapping):
        for n, shape in frozen_shapes.items():
            if ckpt.moe is not None and EXPERTS_INFIX in str(n):
                continue  # rank 0's experts only, by local id: all are read from expert files
            if ckpt.moe is not None and autoep_layer_of(ckpt.moe.layers, str(n)):
                raise UnsupportedCheckpointError(
                    f"{model0.url}: AutoEP expert weight '{n}' is frozen; frozen AutoEP experts "
                    "are not supported (DeepSpeed itself refuses to save them at ZeRO-3)"
                )
            if math.prod(tuple(int(x) for x in shape)) == 0:  # "not owned by the optimizer"
                ckpt.empty_params.append((str(n), tuple(int(x) for x in shape), ckpt.train_dtype))
            else:
                ckpt.frozen.append(_frozen_from_fragments(ckpt, n, shape))
    for name, rank, f, t in ckpt.moe.frozen if ckpt.moe is not None else ():
        if not t.is_contiguous():
            raise CheckpointFormatError(f"{f.url}: frozen expert param '{name}' is not contiguous")
        ckpt.frozen.append(
            FrozenParam(
                name=name, shape=tuple(t.shape), dtype=t.dtype, source="expert file",
                pieces=((rank, t),), url=f.url,
            )
        )  # fmt: skip
    recovered = _frozen_from_module(ckpt, module, buffer_names)
    if recovered:
        why = (
            "DeepSpeed saves no frozen_param_fragments for ZeRO-1"
            if frozen_shapes is None
            else "they are in neither 'param_shapes' nor 'frozen_param_shapes'"
        )
        ckpt.notes.append(
            f"{len(recovered)} frozen param(s) taken from the {ckpt.train_dtype} module weights in "
            f"{model0.url.rsplit('/', 1)[-1]} ({why}; DeepSpeed's converter drops them): "
            + ", ".join(recovered)
        )
    excluded = (
        ckpt.stage >= 2 and "frozen_param_shapes" in obj and frozen_shapes is None and not recovered
    )
    if excluded:
        # DeepSpeed writes None here only when saving with `exclude_frozen_parameters=True`
        # (engine.py: save_frozen_param = partition_gradients and not exclude_frozen_parameters).
        ckpt.notes.append(
            "saved with DeepSpeed's `exclude_frozen_parameters`: frozen parameters are not in "
            "the checkpoint, so the output holds only the trained ones and buffers"
        )
    owners = set(ckpt.param_names) | {fp.name for fp in ckpt.frozen}
    owners |= {n for n, _, _ in ckpt.empty_params}
    for alias, target in list(ckpt.shared.items()):
        if target not in owners and excluded:
            # A tie between frozen params (the HF Trainer saves a PEFT model's frozen, tied
            # embedding this way): neither is in the checkpoint, so neither is in the output.
            del ckpt.shared[alias]
            ckpt.notes.append(
                f"tied param '{alias}' (sharing '{target}') left out with its target: a frozen "
                "param `exclude_frozen_parameters` did not save"
            )
        elif target not in owners:
            raise LayoutMismatchError(
                f"{model0.url}: tied param '{alias}' shares memory with '{target}', which is "
                "neither a trained nor a frozen param of this checkpoint"
            )


def _with_experts(order: list[str], moe: MoELayout) -> list[str]:
    """The module order with the expert params (which `module` leaves out) after the last key
    of their MoE layer, where a model's `state_dict()` has them."""
    out = list(order)
    for layer in moe.layers:
        head = layer.prefix + "."
        mine = [n for n in moe.expert_order if n.startswith(head)]
        at = max((i + 1 for i, k in enumerate(out) if k.startswith(head)), default=len(out))
        out[at:at] = mine
    return out


def _shape_of(
    obj: Mapping[str, Any], module: Mapping[str, Any], name: str, stage: int
) -> tuple[int, ...] | None:
    """A param's shape: `frozen_param_shapes` (ZeRO-2/3), `param_shapes`, or the module copy
    (ZeRO-1/2 only: ZeRO-3 keeps empty placeholders there)."""
    frozen = obj.get("frozen_param_shapes")
    if isinstance(frozen, Mapping) and name in frozen:
        return tuple(int(x) for x in frozen[name])
    for group in obj.get("param_shapes") or ():
        if isinstance(group, Mapping) and name in group:
            return tuple(int(x) for x in group[name])
    t = module.get(name)
    return tuple(t.shape) if isinstance(t, TensorRecord) and stage < 3 else None


def _real_ties(
    ckpt: ZeroCheckpoint, obj: Mapping[str, Any], module: Mapping[str, Any]
) -> dict[str, str]:
    """`shared_params` without the ties DeepSpeed infers between zero-element params: it
    compares `data_ptr()`, and every empty tensor has the same one, so `{empty_b: empty_a}`
    appears though the two share nothing (not even a shape)."""
    shared = obj.get("shared_params") or {}
    ties = {}
    for alias, target in shared.items():
        shapes = [_shape_of(obj, module, str(n), ckpt.stage) for n in (alias, target)]
        if any(sh is not None and math.prod(sh) == 0 for sh in shapes):
            ckpt.notes.append(
                f"DeepSpeed records '{alias}' as tied to '{target}' because both are empty "
                f"(shapes {[list(sh) if sh is not None else None for sh in shapes]}); they "
                "share no memory, so each is written with its own shape (DeepSpeed's "
                "zero_to_fp32 gives the alias the target's tensor, shape included)"
            )
            continue
        ties[str(alias)] = str(target)
    return ties


def _frozen_from_fragments(ckpt: ZeroCheckpoint, name: str, shape: Any) -> FrozenParam:
    """A frozen param listed in `frozen_param_shapes`: its fragment in every model file."""
    shape = tuple(int(s) for s in shape)
    pieces = []
    for f in ckpt.model_files:
        fragments = f.obj.get("frozen_param_fragments") or {}
        t = fragments.get(name)
        if not isinstance(t, TensorRecord):
            raise CheckpointFormatError(
                f"{f.url}: 'frozen_param_fragments' lacks '{name}', listed in 'frozen_param_shapes'"
            )
        if not t.is_contiguous():
            raise CheckpointFormatError(f"{f.url}: frozen fragment '{name}' is not contiguous")
        pieces.append((f.rank, t))
    held = sum(t.numel for _, t in pieces)
    if held < math.prod(shape):
        raise LayoutMismatchError(
            f"{ckpt.tag_url}: frozen param '{name}' has shape {list(shape)} "
            f"({math.prod(shape)} elements) but its fragments hold {held}"
        )
    return FrozenParam(
        name=name, shape=shape, dtype=pieces[0][1].dtype, source="fragments", pieces=tuple(pieces)
    )


def _frozen_from_module(
    ckpt: ZeroCheckpoint, module: Mapping[str, Any], buffer_names: list[str]
) -> list[str]:
    """Module tensors that are no trained param, buffer, frozen param or alias: frozen params
    DeepSpeed saved only in the module copy (ZeRO-1). Adds them; returns their names."""
    model0 = ckpt.model_files[0]
    known = (
        set(ckpt.param_names)
        | {n for n, _ in ckpt.buffers}
        | {fp.name for fp in ckpt.frozen}
        | {n for n, _, _ in ckpt.empty_params}
        | set(ckpt.shared)
    )
    recovered = []
    for name in ckpt.module_order:
        t = module.get(name)  # expert params are in the order, not in `module`
        if name in known or name in buffer_names or not isinstance(t, TensorRecord):
            continue
        if t.numel == 0 and ckpt.stage < 3:  # ZeRO-1/2 leave zero-element params out of groups
            ckpt.empty_params.append((name, tuple(t.shape), t.dtype))
            continue
        if t.numel == 0 and ckpt.stage == 3:
            raise LayoutMismatchError(
                f"{model0.url}: module param '{name}' is neither in 'param_shapes' nor in "
                "'frozen_param_shapes' and ZeRO-3 saved only an empty placeholder for it, so "
                "its values are not in the checkpoint"
            )
        if not t.is_contiguous():
            raise CheckpointFormatError(f"{model0.url}: module tensor '{name}' is not contiguous")
        ckpt.frozen.append(
            FrozenParam(name=name, shape=t.shape, dtype=t.dtype, source="module", pieces=((0, t),))
        )
        recovered.append(name)
    return recovered
