"""The model and run settings, everything derived from them, and the pickled contents of every file."""

from __future__ import annotations

import math
import re
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .pickles import (
    G_DYN_LOSS_SCALER,
    G_FRAGMENT,
    G_LOSS_SCALER,
    G_ZERO_STAGE,
    Global,
    NewObj,
    Reduce,
    Storage,
    tensor,
    torch_size,
    view_again,
)
from .shapes import DEFAULT_BUFFERS, EMBED_WEIGHT, LM_HEAD_WEIGHT
from .values import expected_buffer, norm_dtype

DS_VERSION = "0.19.8"

TRAINING_DTYPES = {
    # training dtype -> (storage class, itemsize, optimizer-file prefix)
    "bf16": ("BFloat16Storage", 2, "bf16_"),
    "fp16": ("HalfStorage", 2, ""),
    "fp32": ("FloatStorage", 4, ""),
}


@dataclass
class Param:
    name: str
    shape: tuple[int, ...]
    index: int  # module order among all params (DeepSpeed's ds_id)
    frozen: bool
    group: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


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


class Spec:
    """The model and run settings, and everything derived from them."""

    def __init__(
        self,
        shapes: Sequence[tuple[str, Sequence[int]]],
        stage: int,
        world_size: int,
        dtype: str,
        tag: str,
        sub_group_numel: int | None,
        tied: bool | Mapping[str, str],
        frozen: Sequence[str],
        groups: int,
        buffers: Sequence[tuple[str, Sequence[int], str]] | None,
        seed: int,
        ds_config: dict[str, Any] | None,
        global_steps: int | None,
        skipped_steps: int,
        micro_batch: int,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: tuple[float, float],
    ) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, not {stage}")
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.stage, self.ws, self.dtype, self.tag, self.seed = (
            stage,
            world_size,
            norm_dtype(dtype),
            tag,
            seed,
        )
        self.lowp_cls, self.lowp_itemsize, self.prefix = TRAINING_DTYPES[self.dtype]
        names = [n for n, _ in shapes]
        if len(set(names)) != len(names):
            raise ValueError("duplicate param names")
        frozen_set = set(frozen)
        if not frozen_set <= set(names):
            raise ValueError(
                f"frozen names not among the params: {sorted(frozen_set - set(names))}"
            )
        self.params = [
            Param(n, tuple(int(d) for d in s), i, n in frozen_set)
            for i, (n, s) in enumerate(shapes)
        ]
        self.by_name = {p.name: p for p in self.params}
        if tied is True:
            tied = {LM_HEAD_WEIGHT: EMBED_WEIGHT}
        self.aliases: dict[str, str] = dict(tied) if tied else {}
        for alias, target in self.aliases.items():
            if alias in self.by_name:
                raise ValueError(
                    f"tied alias {alias!r} is also a real param (use transformer_shapes(tied=True))"
                )
            if target not in self.by_name or self.by_name[target].frozen:
                raise ValueError(f"tied target {target!r} is not a trainable param")
        # module (state_dict) order: an alias sits before the first param of its own module
        # (lm_head.weight before lm_head.bias), else at the end
        self.module_order = [p.name for p in self.params]
        for alias in self.aliases:
            owner = alias.rsplit(".", 1)[0] + "."
            at = next(
                (i for i, n in enumerate(self.module_order) if n.startswith(owner)),
                len(self.module_order),
            )
            self.module_order.insert(at, alias)
        self.buffers = [
            (n, tuple(s), dt) for n, s, dt in (DEFAULT_BUFFERS if buffers is None else buffers)
        ]
        trainable = [p for p in self.params if not p.frozen]
        if not trainable:
            raise ValueError("no trainable params")
        if groups == 1:
            self.groups = [trainable]
        elif (
            groups == 2
        ):  # matrices (with weight decay), then vectors (without): DeepSpeed's usual split
            self.groups = [
                g
                for g in (
                    [p for p in trainable if len(p.shape) >= 2],
                    [p for p in trainable if len(p.shape) < 2],
                )
                if g
            ]
        else:
            raise ValueError("groups must be 1 or 2")
        for gi, g in enumerate(self.groups):
            for p in g:
                p.group = gi
        self.weight_decay = weight_decay if len(self.groups) == 2 else (weight_decay[0],)
        self.frozen = [p for p in self.params if p.frozen]
        # ZeRO-3 flat sub-groups: within each optimizer group, close a sub-group once its params'
        # per-rank pieces (ceil(numel / ws) each) add up to sub_group_numel (DeepSpeed's
        # sub_group_size, default 1e9), as the real fixtures show
        self.sub_group_numel = int(sub_group_numel) if sub_group_numel else 1_000_000_000
        self.sub_groups: list[list[Param]] = []
        self.sub_group_owner: list[int] = []
        for gi, g in enumerate(self.groups):
            cur: list[Param] = []
            total = 0
            for p in g:
                cur.append(p)
                total += -(-p.numel // self.ws)
                if total >= self.sub_group_numel:
                    self.sub_groups.append(cur)
                    self.sub_group_owner.append(gi)
                    cur, total = [], 0
            if cur:
                self.sub_groups.append(cur)
                self.sub_group_owner.append(gi)
        m = re.fullmatch(r"global_step(\d+)", tag)
        self.global_steps = (
            global_steps if global_steps is not None else (int(m.group(1)) if m else 1)
        )
        self.skipped_steps = skipped_steps
        self.micro_batch = micro_batch
        self.lr, self.betas, self.eps = lr, betas, eps
        self.ds_config = ds_config if ds_config is not None else self._default_ds_config()

    # -- shared pieces --------------------------------------------------------------------------
    def _default_ds_config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:
            zero["sub_group_size"] = self.sub_group_numel
            zero["stage3_param_persistence_threshold"] = 0
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 100000,
            "gradient_clipping": 1.0,
            "zero_optimization": zero,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": self.lr,
                    "betas": list(self.betas),
                    "eps": self.eps,
                    "weight_decay": self.weight_decay[0],
                    "torch_adam": True,
                },
            },
        }
        if self.dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif self.dtype == "fp16":
            cfg["fp16"] = {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        return cfg

    def loss_scaler(self) -> NewObj:
        if self.dtype != "fp16":
            return NewObj(G_LOSS_SCALER, {"cur_scale": 1.0, "dynamic": False})
        fp16 = self.ds_config.get("fp16", {})
        return NewObj(
            G_DYN_LOSS_SCALER,
            {
                "cur_scale": float(2 ** fp16.get("initial_scale_power", 16)),
                "dynamic": True,
                "cur_iter": self.global_steps,
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

    def param_group_dict(self, gi: int, params: list[int]) -> dict[str, Any]:
        # with client param groups (2 groups) torch keeps the client's key first; otherwise AdamW's order
        d: dict[str, Any] = {"weight_decay": self.weight_decay[gi]} if len(self.groups) > 1 else {}
        d.update(
            {
                "lr": self.lr,
                "betas": tuple(self.betas),
                "eps": self.eps,
                "weight_decay": self.weight_decay[gi],
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

    def adam_state(self, numel: int, moments: str) -> dict[str, Any]:
        step = struct.pack("<f", float(self.global_steps - self.skipped_steps))
        return {
            "step": tensor(Storage("FloatStorage", 1, raw=step), ()),
            "exp_avg": tensor(self._moment(numel, moments), (numel,)),
            "exp_avg_sq": tensor(self._moment(numel, moments), (numel,)),
        }

    @staticmethod
    def _moment(numel: int, moments: str) -> Storage:
        if moments == "sparse":
            return Storage("FloatStorage", numel, hole=True)
        return Storage("FloatStorage", numel, pieces=[("zeros", None, 0, numel)] if numel else [])

    def buffer_tensors(self) -> list[tuple[str, Reduce]]:
        out = []
        for name, shape, dt in self.buffers:
            data = expected_buffer(name, shape, dt, self.seed)
            cls = "FloatStorage" if dt == "float32" else "LongStorage"
            out.append(
                (
                    name,
                    tensor(
                        Storage(
                            cls, data.size, raw=data.astype(data.dtype.newbyteorder("<")).tobytes()
                        ),
                        shape,
                    ),
                )
            )
        return out

    def lowp_storage(self, pieces: list[tuple[str, str | None, int, int]], numel: int) -> Storage:
        return Storage(self.lowp_cls, numel, pieces=pieces)

    def module_dict(self, param_tensors: Mapping[str, Reduce]) -> OrderedDict[str, Any]:
        module: OrderedDict[str, Any] = OrderedDict()
        for name, t in self.buffer_tensors():
            module[name] = t
        for name in self.module_order:
            module[name] = param_tensors[name]
        module._metadata = _module_metadata([b[0] for b in self.buffers] + self.module_order)  # type: ignore[attr-defined]
        return module

    def model_states(
        self,
        module: OrderedDict[str, Any],
        param_shapes: list[OrderedDict[str, Any]],
        frozen_fragments: OrderedDict[str, Any],
        rank: int,
    ) -> dict[str, Any]:
        frozen_shapes: OrderedDict[str, Any] | None = OrderedDict(
            (p.name, torch_size(p.shape)) for p in self.frozen
        )
        if (
            self.stage == 1
        ):  # DeepSpeed saves frozen params' shapes and fragments only from stage 2 on
            frozen_shapes = frozen_fragments = None  # type: ignore[assignment]
        return {
            "module": module,
            "buffer_names": [b[0] for b in self.buffers],
            "optimizer": None,
            "param_shapes": param_shapes,
            "frozen_param_shapes": frozen_shapes,
            "shared_params": dict(self.aliases) if rank == 0 else {},
            "frozen_param_fragments": frozen_fragments,
            "lr_scheduler": None,
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": self.skipped_steps,
            "global_steps": self.global_steps,
            "global_samples": self.global_steps * self.micro_batch * self.ws,
            "dp_world_size": self.ws,
            "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": self.ds_config,
            "ds_version": DS_VERSION,
        }

    # -- ZeRO-1/2 -------------------------------------------------------------------------------
    def zero2_layout(self) -> list[dict[str, Any]]:
        """Per optimizer group: params with their flat offsets, padded size, partition size, padding."""
        out = []
        align = 2 * self.ws
        for g in self.groups:
            offsets = []
            total = 0
            for p in g:
                offsets.append(total)
                total += p.numel
            padded = -(-total // align) * align
            part = padded // self.ws
            pad = padded - total
            if pad >= part:
                raise ValueError(
                    f"an optimizer group of {total} elements is too small for world size {self.ws}: "
                    f"its padding ({pad}) would cover the last rank's whole partition ({part})"
                )
            out.append(
                {
                    "params": g,
                    "offsets": offsets,
                    "total": total,
                    "padded": padded,
                    "part": part,
                    "pad": pad,
                }
            )
        return out

    def zero2_files(self, moments: str) -> list[tuple[str, dict[str, Any]]]:
        layout = self.zero2_layout()
        files = []
        # model states: the full 16-bit (training dtype) weights, as views into per-group flat storages
        tensors: dict[str, Reduce] = {}
        for lay in layout:
            pieces: list[tuple[str, str | None, int, int]] = [
                ("vals", p.name, 0, p.numel) for p in lay["params"]
            ]
            if lay["pad"]:
                pieces.append(("zeros", None, 0, lay["pad"]))
            st = self.lowp_storage(pieces, lay["padded"])
            for p, off in zip(lay["params"], lay["offsets"], strict=True):
                tensors[p.name] = tensor(st, p.shape, off)
        frozen_fragments: OrderedDict[str, Any] = OrderedDict()
        for p in self.frozen:
            t = tensor(self.lowp_storage([("vals", p.name, 0, p.numel)], p.numel), p.shape)
            tensors[p.name] = t
            frozen_fragments[p.name] = view_again(t)
        for alias, target in self.aliases.items():
            tensors[alias] = view_again(tensors[target])
        param_shapes = [
            OrderedDict((p.name, torch_size(p.shape)) for p in lay["params"]) for lay in layout
        ]
        files.append(
            (
                "mp_rank_00_model_states.pt",
                self.model_states(self.module_dict(tensors), param_shapes, frozen_fragments, 0),
            )
        )
        for r in range(self.ws):
            state: dict[int, Any] = {}
            partitions = []
            paddings = []
            mappings = []
            for gi, lay in enumerate(layout):
                part = lay["part"]
                lo_r, hi_r = r * part, (r + 1) * part
                pieces = []
                mapping: OrderedDict[str, Any] = OrderedDict()
                for p, off in zip(lay["params"], lay["offsets"], strict=True):
                    lo, hi = max(off, lo_r), min(off + p.numel, hi_r)
                    if lo < hi:
                        pieces.append(("vals", p.name, lo - off, hi - lo))
                        mapping[p.name] = NewObj(G_FRAGMENT, {"numel": hi - lo, "start": lo - lo_r})
                tail = hi_r - max(lay["total"], lo_r)
                if tail > 0:
                    pieces.append(("zeros", None, 0, tail))
                pad = lay["pad"] if r == self.ws - 1 else 0
                state[gi] = self.adam_state(part, moments)
                partitions.append(
                    tensor(
                        Storage("FloatStorage", part, pieces=pieces),
                        (part - pad,),
                        requires_grad=True,
                    )
                )
                paddings.append(pad)
                mappings.append(mapping)
            osd = {
                "loss_scaler": self.loss_scaler(),
                "dynamic_loss_scale": self.dtype == "fp16",
                "overflow": False,
                "clip_grad": float(self.ds_config.get("gradient_clipping", 1.0)),
                "base_optimizer_state": {
                    "state": state,
                    "param_groups": [self.param_group_dict(gi, [gi]) for gi in range(len(layout))],
                },
                "single_partition_of_fp32_groups": partitions,
                "zero_stage": Reduce(G_ZERO_STAGE, (self.stage,)),
                "group_paddings": paddings,
                "param_alignment_paddings": [[0] * len(lay["params"]) for lay in layout],
                "partition_count": [self.ws] * len(layout),
                "ds_version": DS_VERSION,
                "param_slice_mappings": mappings,
            }
            files.append(
                (
                    f"{self.prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                    {
                        "optimizer_state_dict": osd,
                        "ds_config": self.ds_config,
                        "ds_version": DS_VERSION,
                    },
                )
            )
        return files

    # -- ZeRO-3 ---------------------------------------------------------------------------------
    def _z3_pieces(self, p: Param, r: int) -> list[tuple[str, str | None, int, int]]:
        c = -(-p.numel // self.ws)
        lo, hi = min(p.numel, r * c), min(p.numel, (r + 1) * c)
        pieces: list[tuple[str, str | None, int, int]] = []
        if hi > lo:
            pieces.append(("vals", p.name, lo, hi - lo))
        if c - (hi - lo):
            pieces.append(("zeros", None, 0, c - (hi - lo)))
        return pieces

    def zero3_files(self, moments: str) -> list[tuple[str, dict[str, Any]]]:
        files = []
        param_shapes_proto = [[(p.name, p.shape) for p in sg] for sg in self.sub_groups]
        for r in range(self.ws):
            tensors: dict[str, Reduce] = {}
            for p in self.params:
                tensors[p.name] = tensor(Storage(self.lowp_cls, 0, pieces=[]), (0,))
            for alias, target in self.aliases.items():
                tensors[alias] = view_again(tensors[target])
            frozen_fragments: OrderedDict[str, Any] = OrderedDict()
            for p in self.frozen:
                c = -(-p.numel // self.ws)
                frozen_fragments[p.name] = tensor(self.lowp_storage(self._z3_pieces(p, r), c), (c,))
            param_shapes = [
                OrderedDict((n, torch_size(s)) for n, s in sg) for sg in param_shapes_proto
            ]
            files.append(
                (
                    f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
                    self.model_states(self.module_dict(tensors), param_shapes, frozen_fragments, r),
                )
            )
        for r in range(self.ws):
            state: dict[int, Any] = {}
            flat = []
            for si, sg in enumerate(self.sub_groups):
                pieces = [pc for p in sg for pc in self._z3_pieces(p, r)]
                numel = sum(-(-p.numel // self.ws) for p in sg)
                state[si] = self.adam_state(numel, moments)
                flat.append(
                    tensor(
                        Storage("FloatStorage", numel, pieces=pieces),
                        (numel,),
                        requires_grad=True,
                        ds_id=f"{sg[0].index}_{sg[-1].index}",
                    )
                )
            groups = [
                [si for si, owner in enumerate(self.sub_group_owner) if owner == gi]
                for gi in range(len(self.groups))
            ]
            osd = {
                "zero_stage": Reduce(G_ZERO_STAGE, (3,)),
                "loss_scaler": self.loss_scaler(),
                "dynamic_loss_scale": self.dtype == "fp16",
                "overflow": False,
                "partition_count": self.ws,
                "optimizer_state_dict": {
                    "state": state,
                    "param_groups": [self.param_group_dict(gi, g) for gi, g in enumerate(groups)],
                },
                "fp32_flat_groups": flat,
            }
            files.append(
                (
                    f"{self.prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                    {
                        "optimizer_state_dict": osd,
                        "ds_config": self.ds_config,
                        "ds_version": DS_VERSION,
                    },
                )
            )
        return files
