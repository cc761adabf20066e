"""Plan a PyTorch DCP checkpoint of a ZeRO checkpoint's training state: every item of
`{"model": ..., "optim": ...}` as `torch.distributed.checkpoint.state_dict.get_state_dict(model,
optimizer)` returns it for the same `nn.Module` with `torch.optim.AdamW`, flattened as DCP's
default planner flattens it (torch 2.13, `torch/distributed/checkpoint/_nested_dict.py`,
`_traverse.py`), each item with the source byte runs it is read from.

- `model.<fqn>`: every entry of the module's `state_dict()`: trained params as their float32
  master, frozen params as their saved 16-bit copy made float32 (exact), buffers in their own
  dtype; a tied alias (`head.weight`) holds the same bytes as the param it shares.
- `optim.state.<fqn>.step`, `.exp_avg`, `.exp_avg_sq`: every trained param (a tied param once,
  under its first name; frozen params have none). `step` is a 0-d float32 tensor, as AdamW keeps
  it; the moments are float32 in the param's shape, read through the masters' plan
  (`zerosafe.training_state.universal_plan`).
- `optim.param_groups.<i>.<key>`: each param group's hyperparameters as the checkpoint's
  optimizer saved them (lr, betas, eps, weight_decay, amsgrad, ...), and `params`, the FQNs of
  the group's params in order. Non-tensor leaves are DCP "bytes" items: a `torch.save` of the
  value.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zerosafe.config import ConvertOptions
from zerosafe.dtypes import dtype_info
from zerosafe.errors import ConfigError, UnsupportedCheckpointError
from zerosafe.formats.deepspeed.reader import zero_layout
from zerosafe.formats.torch_pickle import TensorRecord
from zerosafe.io.storage import Storage
from zerosafe.training_state.universal_plan import (
    Run,
    SourceRecord,
    UniversalPlan,
    plan_universal,
)

__all__ = ["LAYOUTS", "DcpItem", "DcpPlan", "plan_dcp"]

PLAN_FORMAT = 1
LAYOUTS = {
    "torch": {"model": ("", "model"), "optim": ("", "optim")},
    "accelerate": {
        "model": ("pytorch_model_fsdp_0", "model"),
        "optim": ("optimizer_0", "optimizer"),
    },
}
"""`--dcp-layout`: where the model and the optimizer state go, `(folder, top-level key)`.
`torch`: one checkpoint `{"model", "optim"}` (the PyTorch DCP tutorial's `AppState`).
`accelerate`: what accelerate 1.15's `save_fsdp_model` / `save_fsdp_optimizer` write for FSDP2
with `SHARDED_STATE_DICT` (`accelerate/utils/fsdp_utils.py`): `pytorch_model_fsdp_0/` holding
`{"model": ...}` and `optimizer_0/` holding `{"optimizer": ...}`."""
_PLAIN = (bool, int, float, str, type(None))


@dataclass(frozen=True, kw_only=True, slots=True)
class DcpItem:
    """One leaf of the flattened state dict."""

    fqn: str
    """The flattened key (`optim.state.l1.weight.exp_avg`)."""
    path: tuple[str | int, ...]
    """The key's path in the nested dict (DCP's `planner_data`)."""
    kind: str
    """`tensor` or `bytes`."""
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    """The dtype written."""
    src_dtype: str = "float32"
    runs: tuple[Run, ...] = ()
    """Source runs in element order, in elements of `src_dtype`."""
    small: Any = None
    """A `step`: the `TensorRecord` (read whole from rank 0's optimizer file) or a number."""
    value: Any = None
    """A bytes item's value."""
    same_as: str | None = None
    """A tied alias: the item whose stored bytes it shares."""
    folder: str = ""
    """The DCP checkpoint (a folder of OUT; `""`: OUT itself) the item belongs to."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_info(self.dtype).itemsize


@dataclass(kw_only=True)
class DcpPlan:
    job_key: str
    layout: str
    items: list[DcpItem]
    records: list[SourceRecord]
    universal: UniversalPlan
    notes: list[str] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return self.universal.urls

    @property
    def folders(self) -> list[str]:
        """The DCP checkpoints written, each with its own `.metadata` (`""`: OUT itself)."""
        return list(dict.fromkeys(i.folder for i in self.items))

    def to_json(self) -> dict[str, Any]:
        """What `inspect --to dcp` reports."""
        u = self.universal
        tensors = [i for i in self.items if i.kind == "tensor" and i.same_as is None]
        model = [i for i in tensors if i.path[0] == self.items[0].path[0]]
        return {
            "job_key": self.job_key,
            "to": "dcp",
            "layout": self.layout,
            "folders": self.folders,
            "zero_stage": u.stage,
            "world_size": u.world_size,
            "num_params": len(u.params),
            "num_model_entries": sum(1 for i in self.items if i.path[0] == self.items[0].path[0]),
            "masters_bytes": u.masters_bytes,
            "moments_bytes": u.moments_bytes,
            "read_bytes": sum(
                r.numel * dtype_info(i.src_dtype).itemsize for i in tensors for r in i.runs
            ),
            "output_bytes": sum(i.nbytes for i in tensors),
            "model_bytes": sum(i.nbytes for i in model),
            "notes": self.notes,
        }


def plan_dcp(storage: Storage, ckpt_url: str, *, tag: str | None, layout: str = "torch") -> DcpPlan:
    """Read a ZeRO checkpoint's metadata and plan its DCP checkpoint (module docstring), in
    `layout` (`LAYOUTS`).

    Raises:
        ConfigError: An unknown layout.
        UnsupportedCheckpointError: What `--to universal` refuses (pipeline or tensor
            parallel, MoE, low-precision masters, NVMe-offloaded states, optimizers other than
            Adam/AdamW), and zero-element params, in one line.
    """
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown DCP layout '{layout}'; choose one of {', '.join(LAYOUTS)}")
    u = plan_universal(storage, ckpt_url, tag=tag, to="dcp")
    ckpt = u.ckpt
    if ckpt.empty_params:
        raise UnsupportedCheckpointError(
            f"{ckpt.tag_url}: `--to dcp` of zero-element params "
            f"({', '.join(n for n, *_ in ckpt.empty_params[:3])}) is not supported yet"
        )
    wl = zero_layout(ckpt, ConvertOptions())
    if [f.url for f in wl.files] != u.urls:
        raise AssertionError("the weights layout and the universal plan list other files")
    (model_folder, mk), (optim_folder, ok) = LAYOUTS[layout]["model"], LAYOUTS[layout]["optim"]
    records = _RecordTable(u.records)
    params = {p.name: p for p in u.params}
    items: list[DcpItem] = []
    for name in wl.order:
        target = wl.aliases.get(name)
        if target is not None:
            t = wl.tensors[target]
            items.append(
                DcpItem(fqn=f"{mk}.{name}", path=(mk, name), kind="tensor",
                        shape=t.shape, dtype=_model_dtype(t.role, t.dtype),
                        same_as=f"{mk}.{target}", folder=model_folder)
            )  # fmt: skip
            continue
        t = wl.tensors[name]
        if name in params:
            runs = params[name].runs["fp32"]
            src = "float32"
        else:
            runs = _fragment_runs(wl, records, name)
            src = t.dtype
        items.append(
            DcpItem(fqn=f"{mk}.{name}", path=(mk, name), kind="tensor", shape=t.shape,
                    dtype=_model_dtype(t.role, src), src_dtype=src, runs=runs,
                    folder=model_folder)
        )  # fmt: skip
    steps = _steps(u)
    for p in u.params:
        base = (ok, "state", p.name)
        items.append(
            DcpItem(fqn=f"{ok}.state.{p.name}.step", path=(*base, "step"), kind="tensor",
                    shape=(), small=steps[p.group], folder=optim_folder)
        )  # fmt: skip
        for state in ("exp_avg", "exp_avg_sq"):
            items.append(
                DcpItem(fqn=f"{ok}.state.{p.name}.{state}", path=(*base, state),
                        kind="tensor", shape=p.shape, runs=p.runs[state], folder=optim_folder)
            )  # fmt: skip
    for i, group in enumerate(_param_groups(u)):
        for key, value in group.items():
            items.append(
                DcpItem(fqn=f"{ok}.param_groups.{i}.{key}",
                        path=(ok, "param_groups", i, key), kind="bytes", value=value,
                        folder=optim_folder)
            )  # fmt: skip
    blob = json.dumps(
        {"dcp": PLAN_FORMAT, "universal": u.job_key, "layout": layout}, sort_keys=True
    )
    notes = [n for n in u.notes if "ds_to_universal" not in n and "optimizer_state.pt" not in n]
    if wl.aliases:
        notes.append(
            "tied params: "
            + ", ".join(f"{mk}.{a} shares the bytes of {mk}.{t}" for a, t in wl.aliases.items())
            + " (the optimizer state is under the first name only, as get_state_dict gives it)"
        )
    return DcpPlan(
        job_key=hashlib.sha256(blob.encode()).hexdigest(), layout=layout, items=items, records=records.records,
        universal=u, notes=notes,
    )  # fmt: skip


def _model_dtype(role: str, src_dtype: str) -> str:
    """Params (trained or frozen) are written float32, buffers in their own dtype."""
    return src_dtype if role == "buffer" else "float32"


class _RecordTable:
    def __init__(self, records: list[SourceRecord]) -> None:
        self.records = list(records)
        self._index = {r.key: i for i, r in enumerate(self.records)}

    def index(self, record: SourceRecord) -> int:
        found = self._index.get(record.key)
        if found is None:
            found = self._index[record.key] = len(self.records)
            self.records.append(record)
        return found


def _fragment_runs(layout: Any, records: _RecordTable, name: str) -> tuple[Run, ...]:
    """A frozen param's or buffer's fragments as runs, checked to tile it in order."""
    t = layout.tensors[name]
    runs = []
    filled = 0
    for slot_index, src, numel, dst in sorted(t.fragments, key=lambda f: f[3]):
        if dst != filled:
            raise UnsupportedCheckpointError(
                f"{layout.where}: '{name}' is not tiled by its fragments (a gap at element "
                f"{filled}); `--to dcp` of it is not supported yet"
            )
        slot = layout.slots[slot_index]
        key = f"{layout.files[slot.file].url}#{slot.record}@{slot.record_offset}"
        record = records.index(
            SourceRecord(key=key, file=slot.file, data_offset=slot.record_offset,
                         size_bytes=slot.record_size_bytes, crc32=slot.record_crc32)
        )  # fmt: skip
        runs.append(Run(slot.file, slot.byte_offset + src * slot.itemsize, numel, record))
        filled += numel
    if filled != math.prod(t.shape):
        raise UnsupportedCheckpointError(
            f"{layout.where}: '{name}' has {filled} of its {math.prod(t.shape)} elements in the "
            "checkpoint; `--to dcp` of it is not supported yet"
        )
    return tuple(runs)


def _inner(u: UniversalPlan) -> Mapping[str, Any]:
    osd = u.ckpt.optim_files[0].obj["optimizer_state_dict"]
    inner = osd["optimizer_state_dict" if u.stage == 3 else "base_optimizer_state"]
    assert isinstance(inner, Mapping)
    return inner


def _steps(u: UniversalPlan) -> dict[int, Any]:
    """Each flat group's `step` (ZeRO-1/2: per param group; ZeRO-3: per sub-group)."""
    state = _inner(u)["state"]
    out = {}
    for g, entry in state.items():
        step = entry.get("step") if isinstance(entry, Mapping) else None
        if isinstance(step, TensorRecord):
            if step.numel != 1:
                raise UnsupportedCheckpointError(
                    f"{u.ckpt.tag_url}: the step of group {g} is a tensor of shape "
                    f"{list(step.shape)}, expected one number; `--to dcp` of it is not supported"
                )
        elif not isinstance(step, (int, float)):
            raise UnsupportedCheckpointError(
                f"{u.ckpt.tag_url}: group {g} of the optimizer state has no 'step'; "
                "`--to dcp` of it is not supported yet"
            )
        out[int(g)] = step
    for p in u.params:
        if p.group not in out:
            raise UnsupportedCheckpointError(
                f"{u.ckpt.tag_url}: no optimizer state for group {p.group} (param '{p.name}'); "
                "`--to dcp` of it is not supported yet"
            )
    return out


def _adamw_mode(u: UniversalPlan) -> bool:
    """Whether DeepSpeed's own Adam (FusedAdam, DeepSpeedCPUAdam) decoupled weight decay: type
    `AdamW`, or `Adam` with `adam_w_mode` (DeepSpeed's default: True)."""
    config = u.ckpt.optim_files[0].obj.get("ds_config")
    optimizer = config.get("optimizer") if isinstance(config, Mapping) else None
    if not isinstance(optimizer, Mapping):
        return True
    params = optimizer.get("params")
    mode = params.get("adam_w_mode", True) if isinstance(params, Mapping) else True
    return str(optimizer.get("type", "")).lower() == "adamw" or bool(mode)


def _torch_adamw_group(u: UniversalPlan, i: int, g: Mapping[str, Any]) -> dict[str, Any]:
    """A group's hyperparameters with torch AdamW's keys. torch's own Adam/AdamW saved them
    (`decoupled_weight_decay` among them): as saved. DeepSpeed's FusedAdam and
    DeepSpeedCPUAdam save `lr`, `betas`, `eps`, `weight_decay`, `bias_correction`, `amsgrad`:
    those, and torch's defaults for the rest.

    Raises:
        UnsupportedCheckpointError: Where torch's AdamW would not continue the same update:
            no bias correction, or L2 weight decay (Adam without AdamW mode) that is not 0.
    """
    hyper = {k: v for k, v in g.items() if k != "params"}
    if "decoupled_weight_decay" not in hyper:
        if hyper.get("bias_correction", True) is not True:
            raise UnsupportedCheckpointError(
                f"{u.ckpt.tag_url}: param group {i} runs Adam without bias correction, which "
                "torch's AdamW always applies; `--to dcp` of it is not supported"
            )
        hyper = {
            "lr": hyper["lr"], "betas": tuple(hyper["betas"]), "eps": hyper["eps"],
            "weight_decay": hyper["weight_decay"], "amsgrad": hyper.get("amsgrad", False),
            "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": _adamw_mode(u),
        }  # fmt: skip
    if not hyper["decoupled_weight_decay"] and hyper.get("weight_decay", 0) != 0:
        raise UnsupportedCheckpointError(
            f"{u.ckpt.tag_url}: param group {i} runs Adam with L2 weight decay "
            f"{hyper['weight_decay']} (not AdamW's decoupled decay), which torch's AdamW would "
            "change on load; `--to dcp` of it is not supported"
        )
    return hyper


def _param_groups(u: UniversalPlan) -> list[dict[str, Any]]:
    """Each param group: its hyperparameters (`_torch_adamw_group`), then `params`, the FQNs
    in order."""
    groups = _inner(u)["param_groups"]
    out = []
    for i, g in enumerate(groups):
        flat = g["params"] if u.stage == 3 else [i]  # ZeRO-3: the group's sub-groups
        names = [p.name for p in u.params if p.group in flat]
        hyper = _torch_adamw_group(u, i, g)
        for k, v in hyper.items():
            if not (isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(
                isinstance(x, _PLAIN) for x in v
            ))):  # fmt: skip
                raise UnsupportedCheckpointError(
                    f"{u.ckpt.tag_url}: param group {i}'s '{k}' is {type(v).__name__}, expected "
                    "a number, a flag or a tuple; `--to dcp` of it is not supported yet"
                )
        out.append({**hyper, "params": names})
    grouped = sum(len(g["params"]) for g in out)
    if grouped != len(u.params):
        raise UnsupportedCheckpointError(
            f"{u.ckpt.tag_url}: the optimizer's param groups hold {grouped} of the "
            f"{len(u.params)} trained params; `--to dcp` of it is not supported yet"
        )
    return out
