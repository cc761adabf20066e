"""Contents both ZeRO layouts share: the model-states dict with its module state_dict, buffers
and bookkeeping, the optimizer-states file, the loss scaler, param groups and Adam state."""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from .pickles import (
    G_DYN_LOSS_SCALER,
    G_LOSS_SCALER,
    Global,
    NewObj,
    Piece,
    Reduce,
    Storage,
    tensor,
    torch_size,
)
from .spec import DS_VERSION, Spec
from .values import expected_buffer


def loss_scaler(spec: Spec) -> NewObj:
    if spec.dtype != "fp16":
        return NewObj(G_LOSS_SCALER, {"cur_scale": 1.0, "dynamic": False})
    fp16 = spec.ds_config.get("fp16", {})
    return NewObj(
        G_DYN_LOSS_SCALER,
        {
            "cur_scale": float(2 ** fp16.get("initial_scale_power", 16)),
            "dynamic": True,
            "cur_iter": spec.global_steps,
            "last_overflow_iter": -1,
            "scale_factor": 2.0,
            "scale_window": fp16.get("loss_scale_window", 1000),
            "min_scale": fp16.get("min_loss_scale", 1),
            "delayed_shift": fp16.get("hysteresis", 2),
            "cur_hysteresis": fp16.get("hysteresis", 2),
            "consecutive_hysteresis": False,
            "raise_error_at_min_scale": True,
            "dtype": Global("torch", "float16"),
        },
    )


def param_group_dict(spec: Spec, gi: int, params: list[int]) -> dict[str, Any]:
    # with client param groups (2 groups) torch keeps the client's key first; otherwise AdamW's order
    d: dict[str, Any] = {"weight_decay": spec.weight_decay[gi]} if len(spec.groups) > 1 else {}
    d.update(
        {
            "lr": spec.lr,
            "betas": tuple(spec.betas),
            "eps": spec.eps,
            "weight_decay": spec.weight_decay[gi],
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
            "params": params,
        }
    )
    return d


def adam_state(spec: Spec, numel: int, moments: str) -> dict[str, Any]:
    step = struct.pack("<f", float(spec.global_steps - spec.skipped_steps))
    return {
        "step": tensor(Storage("FloatStorage", 1, raw=step), ()),
        "exp_avg": tensor(_moment(numel, moments), (numel,)),
        "exp_avg_sq": tensor(_moment(numel, moments), (numel,)),
    }


def _moment(numel: int, moments: str) -> Storage:
    if moments == "sparse":
        return Storage("FloatStorage", numel, hole=True)
    return Storage("FloatStorage", numel, pieces=[("zeros", None, 0, numel)] if numel else [])


def lowp_storage(spec: Spec, pieces: list[Piece], numel: int) -> Storage:
    """A storage of the training dtype (the module's weights, frozen params' fragments)."""
    return Storage(spec.lowp_cls, numel, pieces=pieces)


def _buffer_tensors(spec: Spec) -> list[tuple[str, Reduce]]:
    out = []
    for name, shape, dt in spec.buffers:
        data = expected_buffer(name, shape, dt, spec.seed)
        cls = "FloatStorage" if dt == "float32" else "LongStorage"
        raw = data.astype(data.dtype.newbyteorder("<")).tobytes()
        out.append((name, tensor(Storage(cls, data.size, raw=raw), shape)))
    return out


def _module_metadata(names: Sequence[str]) -> OrderedDict[str, dict[str, int]]:
    meta: OrderedDict[str, dict[str, int]] = OrderedDict()
    meta[""] = {"version": 1}
    for name in names:
        parts = name.split(".")[:-1]
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in meta:
                meta[prefix] = {"version": 1}
    return meta


def module_dict(spec: Spec, param_tensors: Mapping[str, Reduce]) -> OrderedDict[str, Any]:
    """The module's state_dict: buffers, then params and aliases in module order."""
    module: OrderedDict[str, Any] = OrderedDict()
    for name, t in _buffer_tensors(spec):
        module[name] = t
    for name in spec.module_order:
        module[name] = param_tensors[name]
    module._metadata = _module_metadata([b[0] for b in spec.buffers] + spec.module_order)  # type: ignore[attr-defined]
    return module


def model_states(
    spec: Spec,
    module: OrderedDict[str, Any],
    param_shapes: list[OrderedDict[str, Any]],
    frozen_fragments: OrderedDict[str, Any],
    rank: int,
) -> dict[str, Any]:
    frozen_shapes: OrderedDict[str, Any] | None = OrderedDict(
        (p.name, torch_size(p.shape)) for p in spec.frozen
    )
    if spec.stage == 1:  # DeepSpeed saves frozen params' shapes and fragments only from stage 2 on
        frozen_shapes = frozen_fragments = None  # type: ignore[assignment]
    return {
        "module": module,
        "buffer_names": [b[0] for b in spec.buffers],
        "optimizer": None,
        "param_shapes": param_shapes,
        "frozen_param_shapes": frozen_shapes,
        "shared_params": dict(spec.aliases) if rank == 0 else {},
        "frozen_param_fragments": frozen_fragments,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": spec.skipped_steps,
        "global_steps": spec.global_steps,
        "global_samples": spec.global_steps * spec.micro_batch * spec.ws,
        "dp_world_size": spec.ws,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": spec.ds_config,
        "ds_version": DS_VERSION,
    }


def optim_file(spec: Spec, rank: int, osd: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A rank's optimizer-states file: its name and contents around the optimizer state dict."""
    return (
        f"{spec.prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        {"optimizer_state_dict": osd, "ds_config": spec.ds_config, "ds_version": DS_VERSION},
    )
