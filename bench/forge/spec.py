"""The model and run settings, and the layout derived from them: params, ties, module order,
optimizer groups and ZeRO-3 flat sub-groups. What goes into each file is in `states`, `zero2`
and `zero3`."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .shapes import DEFAULT_BUFFERS, EMBED_WEIGHT, LM_HEAD_WEIGHT
from .values import norm_dtype

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
        self.params = _params(shapes, frozen)
        self.by_name = {p.name: p for p in self.params}
        self.aliases = _aliases(tied, self.by_name)
        self.module_order = _module_order(self.params, self.aliases)
        self.buffers = [
            (n, tuple(s), dt) for n, s, dt in (DEFAULT_BUFFERS if buffers is None else buffers)
        ]
        self.groups = _optimizer_groups(self.params, groups)
        self.weight_decay = weight_decay if len(self.groups) == 2 else (weight_decay[0],)
        self.frozen = [p for p in self.params if p.frozen]
        self.sub_group_numel = int(sub_group_numel) if sub_group_numel else 1_000_000_000
        self.sub_groups, self.sub_group_owner = _sub_groups(
            self.groups, self.ws, self.sub_group_numel
        )
        m = re.fullmatch(r"global_step(\d+)", tag)
        self.global_steps = (
            global_steps if global_steps is not None else (int(m.group(1)) if m else 1)
        )
        self.skipped_steps = skipped_steps
        self.micro_batch = micro_batch
        self.lr, self.betas, self.eps = lr, betas, eps
        self.ds_config = ds_config if ds_config is not None else self._default_ds_config()

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


def _params(shapes: Sequence[tuple[str, Sequence[int]]], frozen: Sequence[str]) -> list[Param]:
    names = [n for n, _ in shapes]
    if len(set(names)) != len(names):
        raise ValueError("duplicate param names")
    frozen_set = set(frozen)
    if not frozen_set <= set(names):
        raise ValueError(f"frozen names not among the params: {sorted(frozen_set - set(names))}")
    return [
        Param(n, tuple(int(d) for d in s), i, n in frozen_set) for i, (n, s) in enumerate(shapes)
    ]


def _aliases(tied: bool | Mapping[str, str], by_name: Mapping[str, Param]) -> dict[str, str]:
    if tied is True:
        tied = {LM_HEAD_WEIGHT: EMBED_WEIGHT}
    aliases: dict[str, str] = dict(tied) if tied else {}
    for alias, target in aliases.items():
        if alias in by_name:
            raise ValueError(
                f"tied alias {alias!r} is also a real param (use transformer_shapes(tied=True))"
            )
        if target not in by_name or by_name[target].frozen:
            raise ValueError(f"tied target {target!r} is not a trainable param")
    return aliases


def _module_order(params: Sequence[Param], aliases: Mapping[str, str]) -> list[str]:
    """Module (state_dict) order: an alias sits before the first param of its own module
    (lm_head.weight before lm_head.bias), else at the end."""
    order = [p.name for p in params]
    for alias in aliases:
        owner = alias.rsplit(".", 1)[0] + "."
        at = next((i for i, n in enumerate(order) if n.startswith(owner)), len(order))
        order.insert(at, alias)
    return order


def _optimizer_groups(params: Sequence[Param], groups: int) -> list[list[Param]]:
    """The trainable params in 1 group, or 2: matrices (with weight decay), then vectors
    (without), DeepSpeed's usual split. Sets each param's `group`."""
    trainable = [p for p in params if not p.frozen]
    if not trainable:
        raise ValueError("no trainable params")
    if groups == 1:
        out = [trainable]
    elif groups == 2:
        matrices = [p for p in trainable if len(p.shape) >= 2]
        vectors = [p for p in trainable if len(p.shape) < 2]
        out = [g for g in (matrices, vectors) if g]
    else:
        raise ValueError("groups must be 1 or 2")
    for gi, g in enumerate(out):
        for p in g:
            p.group = gi
    return out


def _sub_groups(
    groups: Sequence[Sequence[Param]], ws: int, sub_group_numel: int
) -> tuple[list[list[Param]], list[int]]:
    """ZeRO-3 flat sub-groups and the optimizer group owning each: within each optimizer group,
    close a sub-group once its params' per-rank pieces (ceil(numel / ws) each) add up to
    `sub_group_numel` (DeepSpeed's sub_group_size, default 1e9), as the real fixtures show."""
    sub_groups: list[list[Param]] = []
    owner: list[int] = []
    for gi, g in enumerate(groups):
        cur: list[Param] = []
        total = 0
        for p in g:
            cur.append(p)
            total += -(-p.numel // ws)
            if total >= sub_group_numel:
                sub_groups.append(cur)
                owner.append(gi)
                cur, total = [], 0
        if cur:
            sub_groups.append(cur)
            owner.append(gi)
    return sub_groups, owner
