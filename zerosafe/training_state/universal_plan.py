"""Plan a DeepSpeed universal checkpoint from a ZeRO checkpoint: what each output file holds,
as byte runs of the source files. Reads pickles and zip headers only.

What DeepSpeed 0.19.8's `ds_to_universal.py` writes and its loader reads
(`deepspeed/checkpoint/ds_to_universal.py`, `universal_checkpoint.py`,
`runtime/base_optimizer.py` `load_hp_checkpoint_state_from_checkpoint_dir`,
`runtime/zero/stage3.py` `load_hp_checkpoint_state_from_checkpoint_dir_stage3`), in
`OUT/<tag>_universal/`:

- `zero/<param>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`: one trained param's master weights
  and Adam moments, whole, float32. ZeRO-1/2: `{'param': tensor in the param's shape,
  'cat_dim': 0}`, plus `step.pt` (the param group's `step`, as the optimizer saved it).
  ZeRO-3: the bare flat 1-D tensor. `fp32.pt`'s tensor has `requires_grad=True`.
- ZeRO-1/2 only: `zero/<name>/fp32.pt` = `{'param': module_tensor.float()}` for every other
  entry of the 16-bit module copy (frozen params, buffers, tied aliases); the loader does not
  read them, `ds_to_universal.py` writes them.
DeepSpeed's `BF16_Optimizer` (bf16 + ZeRO-1 + `grad_accum_dtype: fp32`) saves the same keys
as ZeRO-1/2 but for `zero_stage`, its partitions whole (padding included): the same files.

- `zero/optimizer_state.pt`: rank 0's `optimizer_state_dict` less its partitioned tensors, plus
  `param_groups` (the hyperparameters). ZeRO-1/2: less `base_optimizer_state`,
  `param_slice_mappings`, `single_partition_of_fp32_groups`, exactly as DeepSpeed. ZeRO-3:
  DeepSpeed keeps rank 0's `fp32_flat_groups` and moments in it, which its loader never reads
  (it reads `optimizer_state_dict['state'][0]['step']`, `param_groups`, the loss scaler):
  zerosafe leaves those tensors out, so this file stays small whatever the model.
- A copy of every `*_model_states.pt` of the tag.

The moments are read through the masters' plan: each Adam state of a flat group (ZeRO-1/2:
`base_optimizer_state['state'][g]`; ZeRO-3: `optimizer_state_dict['state'][sub_group]`) has
the masters' partition layout, so a param's fragment at element `e` of a master partition is
at element `e` of the same rank's moment tensor of that group. Fragments come from
`param_shapes` (`zerosafe.formats.deepspeed.reader.zero_layout`), never from
`param_slice_mappings`, which `round_robin_gradients` runs get wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zerosafe.config import ConvertOptions
from zerosafe.dtypes import dtype_info
from zerosafe.errors import LayoutMismatchError, UnsupportedCheckpointError
from zerosafe.formats.deepspeed.checkpoint import LoadedFile, ZeroCheckpoint, open_zero_checkpoint
from zerosafe.formats.deepspeed.reader import zero_layout
from zerosafe.formats.torch_pickle import InertObject, TensorRecord
from zerosafe.io.storage import Storage, normalize_url
from zerosafe.training_state.client_files import find_client_files

__all__ = [
    "MOMENTS",
    "STATES",
    "ModuleCopy",
    "ParamOut",
    "Run",
    "SourceRecord",
    "UniversalPlan",
    "plan_universal",
]

STATES = ("fp32", "exp_avg", "exp_avg_sq")
"""The per-param files, in the order they are written."""
MOMENTS = ("exp_avg", "exp_avg_sq")
PLAN_FORMAT = 1
_SMALL_TENSOR_BYTES = 1 << 20
"""Tensors kept in `optimizer_state.pt` (steps, scalars) are read whole: at most this each."""
_Z12_DROPPED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
_GROUP_RE = re.compile(r"^fp32/group(\d+)$")


@dataclass(frozen=True, slots=True)
class Run:
    """`numel` float32 elements at byte `offset` of source file `file` (index into `urls`),
    inside zip record `record` (index into `UniversalPlan.records`; -1: none, a raw copy)."""

    file: int
    offset: int
    numel: int
    record: int = -1


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceRecord:
    """A zip record runs read from: its bytes are checked against its CRC-32 at the end."""

    key: str
    """`<file url>#<record name>@<data offset>`, as the weights path names records."""
    file: int
    data_offset: int
    size_bytes: int
    crc32: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamOut:
    """One trained param: its folder's files, each state as runs in element order."""

    name: str
    shape: tuple[int, ...]
    group: int
    """ZeRO-1/2: the optimizer param group (its `step` goes to `step.pt`)."""
    runs: dict[str, tuple[Run, ...]]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleCopy:
    """ZeRO-1/2: a module entry without masters, written as `{'param': t.float()}`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    run: Run
    """In elements of `dtype`."""


@dataclass(kw_only=True)
class UniversalPlan:
    """Everything a `--to universal` run writes (see the module docstring)."""

    job_key: str
    tag: str
    folder: str
    """The universal folder's name, `<tag>_universal`."""
    stage: int
    world_size: int
    urls: list[str]
    """Source files by index: the optimizer files, then the model states."""
    params: list[ParamOut]
    module_copies: list[ModuleCopy]
    model_files: list[str]
    """URLs of the model states files, copied unchanged."""
    optimizer_state: dict[str, Any]
    """`optimizer_state.pt`'s object, `TensorRecord`s (small) still to be read."""
    records: list[SourceRecord]
    """The zip records the runs read, each checked against its CRC-32 once all are read."""
    steps: dict[int, Any]
    """ZeRO-1/2: each param group's `step` (an int or a scalar `TensorRecord`)."""
    ckpt: ZeroCheckpoint
    notes: list[str] = field(default_factory=list)
    client_files: list[str] = field(default_factory=list)
    """The training client's files (and model files) in the checkpoint folder, carried into
    the output unread (`zerosafe.training_state.client_files`), relative to
    `ckpt.ckpt_url`."""

    @property
    def masters_bytes(self) -> int:
        return 4 * sum(p.numel for p in self.params)

    @property
    def moments_bytes(self) -> int:
        return 2 * self.masters_bytes

    def to_json(self) -> dict[str, Any]:
        """What `inspect --to universal` reports."""
        model_bytes = sum(f.identity.size_bytes for f in self.ckpt.model_files)
        return {
            "job_key": self.job_key,
            "to": "universal",
            "folder": self.folder,
            "zero_stage": self.stage,
            "world_size": self.world_size,
            "num_params": len(self.params),
            "num_module_copies": len(self.module_copies),
            "masters_bytes": self.masters_bytes,
            "moments_bytes": self.moments_bytes,
            "model_states_bytes": model_bytes,
            "read_bytes": self.masters_bytes
            + self.moments_bytes
            + model_bytes
            + sum(c.run.numel * _itemsize(c.dtype) for c in self.module_copies),
            "output_bytes": 3 * self.masters_bytes
            + model_bytes
            + 4 * sum(c.run.numel for c in self.module_copies),
            "client_files": self.client_files,
            "notes": self.notes,
        }


def _itemsize(dtype: str) -> int:
    return dtype_info(dtype).itemsize


def plan_universal(
    storage: Storage, ckpt_url: str, *, tag: str | None, to: str = "universal"
) -> UniversalPlan:
    """Read a ZeRO checkpoint's metadata and plan its universal checkpoint.

    `to` names the output in refusals: `--to dcp` reads the same masters and moments through
    this plan and refuses the same checkpoints.

    Raises:
        UnsupportedCheckpointError: For what is not converted to universal yet, in one line
            naming it (pipeline or tensor parallel, MoE, low-precision masters,
            NVMe-offloaded states, optimizers other than Adam/AdamW).
        CheckpointFormatError: Missing or unreadable files.
        LayoutMismatchError: Moments that do not match their master partitions.
    """
    try:
        return _plan(storage, ckpt_url, tag=tag)
    except UnsupportedCheckpointError as e:
        if to == "universal":
            raise
        raise UnsupportedCheckpointError(
            str(e).replace("`--to universal`", f"`--to {to}`")
        ) from None


def _plan(storage: Storage, ckpt_url: str, *, tag: str | None) -> UniversalPlan:
    opened = open_zero_checkpoint(storage, normalize_url(ckpt_url), tag=tag)
    if not isinstance(opened, ZeroCheckpoint):
        raise UnsupportedCheckpointError(
            f"{ckpt_url}: `--to universal` of a pipeline- or tensor-parallel checkpoint is not "
            "supported yet (only data-parallel ZeRO-1/2/3 checkpoints)"
        )
    ckpt = opened
    _refuse(ckpt)
    layout = zero_layout(ckpt, ConvertOptions())
    urls = [f.url for f in layout.files]
    records = _Records(urls)
    moment_base = _moment_bases(ckpt, records)
    params = []
    trained = {name for name, _ in ckpt.trained_params}
    for name, shape in ckpt.trained_params:
        tensor = layout.tensors[name]
        runs: dict[str, list[Run]] = {s: [] for s in STATES}
        groups = set()
        for slot_index, src, numel, _dst in sorted(tensor.fragments, key=lambda f: f[3]):
            slot = layout.slots[slot_index]
            m = _GROUP_RE.match(slot.name)
            assert m is not None and slot.kind == "fp32" and slot.dtype == "float32"
            group = int(m.group(1))
            groups.add(group)
            record = records.index(
                slot.file, slot.record, slot.record_offset, slot.record_size_bytes,
                slot.record_crc32,
            )  # fmt: skip
            runs["fp32"].append(Run(slot.file, slot.byte_offset + 4 * src, numel, record))
            for state in MOMENTS:
                base, record = moment_base[(slot.rank, group, state)]
                runs[state].append(Run(slot.file, base + 4 * src, numel, record))
        params.append(
            ParamOut(
                name=name, shape=shape, group=min(groups) if groups else 0,
                runs={s: tuple(r) for s, r in runs.items()},
            )
        )  # fmt: skip
    model0 = ckpt.model_files[0]
    copies = _module_copies(ckpt, model0, trained, records) if ckpt.stage < 3 else []
    osd = ckpt.optim_files[0].obj["optimizer_state_dict"]
    optimizer_state, steps = _optimizer_state(ckpt, osd)
    identities = [
        {"url": f.url, "size_bytes": f.identity.size_bytes, "version": f.identity.version}
        for f in ckpt.files
    ]
    blob = json.dumps(
        {"universal": PLAN_FORMAT, "tag": ckpt.tag, "files": identities}, sort_keys=True
    )
    # the weights path's notes on frozen params taken from the module copy: here they are
    # module copies like every other entry without masters, said once below
    notes = [n for n in ckpt.notes if "frozen param(s) taken from" not in n]
    if copies:
        notes.append(
            f"{len(copies)} module entries without masters (frozen params, buffers, tied "
            "aliases) written as {'param': t.float()}, as ds_to_universal.py does; DeepSpeed's "
            "universal loader does not read them (the training script's values stand)"
        )
    if ckpt.stage == 3:
        notes.append(
            "optimizer_state.pt leaves out rank 0's fp32_flat_groups and moments, which "
            "DeepSpeed's ds_to_universal copies there and its loader never reads"
        )
    client_files, client_notes = find_client_files(storage, ckpt.ckpt_url)
    notes += client_notes
    return UniversalPlan(
        job_key=hashlib.sha256(blob.encode()).hexdigest(), tag=ckpt.tag,
        folder=f"{ckpt.tag}_universal", stage=ckpt.stage, world_size=ckpt.world_size,
        urls=urls, params=params, module_copies=copies,
        model_files=[f.url for f in ckpt.model_files], optimizer_state=optimizer_state, steps=steps, records=records.records,
        ckpt=ckpt, notes=notes, client_files=client_files,
    )  # fmt: skip


def _refuse(ckpt: ZeroCheckpoint) -> None:
    """One line naming what `--to universal` does not convert yet."""
    what = None
    if ckpt.moe is not None:
        what = "MoE (expert-parallel) checkpoints"
    elif ckpt.optimizer_kind not in ("zero", "bf16_optimizer"):
        what = f"optimizer kind '{ckpt.optimizer_kind}'"
    elif ckpt.master_dtype != "float32":
        what = f"low-precision ({ckpt.master_dtype}) master weights"
    elif ckpt.swapped:
        what = "NVMe-offloaded optimizer states (offload_optimizer device nvme)"
    elif "muon" in ckpt.optimizer_name.lower() or not ckpt.optimizer_name.endswith(
        "(state exp_avg, exp_avg_sq)"
    ):
        what = f"optimizer {ckpt.optimizer_name} (Adam/AdamW only)"
    if what is not None:
        raise UnsupportedCheckpointError(
            f"{ckpt.tag_url}: `--to universal` of {what} is not supported yet"
        )


def _state_of(f: LoadedFile, stage: int) -> Mapping[Any, Any]:
    osd = f.obj["optimizer_state_dict"]
    inner = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    state = inner.get("state") if isinstance(inner, Mapping) else None
    if not isinstance(state, Mapping):
        key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
        raise UnsupportedCheckpointError(
            f"{f.url}: `{key}` holds no per-group 'state' dict (an elastic checkpoint, or one "
            "saved before the first step); `--to universal` of it is not supported yet"
        )
    return state


class _Records:
    """The table of source records, each entered once."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.records: list[SourceRecord] = []
        self._index: dict[str, int] = {}

    def index(self, file: int, name: str, data_offset: int, size_bytes: int, crc32: int) -> int:
        key = f"{self.urls[file]}#{name}@{data_offset}"
        found = self._index.get(key)
        if found is None:
            found = self._index[key] = len(self.records)
            self.records.append(
                SourceRecord(key=key, file=file, data_offset=data_offset,
                             size_bytes=size_bytes, crc32=crc32)
            )  # fmt: skip
        return found

    def of_tensor(self, f: LoadedFile, t: TensorRecord) -> int:
        record = f.zip.storage_record(t.storage.key)
        file = self.urls.index(f.url)
        return self.index(
            file, record.name, f.zip.data_offset(record), record.size_bytes, record.crc32
        )


def _moment_bases(
    ckpt: ZeroCheckpoint, records: _Records
) -> dict[tuple[int, int, str], tuple[int, int]]:
    """`(rank, group, state) ->` (absolute byte offset of element 0 of that moment partition,
    its record), checked against the master partition it mirrors."""
    out = {}
    for f in ckpt.optim_files:
        state = _state_of(f, ckpt.stage)
        for g, master in enumerate(ckpt.fp32_partitions[f.rank]):
            entry = state.get(g)
            for key in MOMENTS:
                t = entry.get(key) if isinstance(entry, Mapping) else None
                if not isinstance(t, TensorRecord):
                    raise LayoutMismatchError(
                        f"{f.url}: no '{key}' tensor for group {g} of rank {f.rank}; an Adam "
                        "optimizer saves one per flat group. Was it saved before the first step?"
                    )
                if t.dtype != "float32" or not t.is_contiguous() or t.numel < master.numel:
                    raise LayoutMismatchError(
                        f"{f.url}: '{key}' of group {g} is {t.numel} x {t.dtype}, expected at "
                        f"least the {master.numel} float32 elements of its master partition"
                    )
                out[(f.rank, g, key)] = (f.zip.tensor_offset(t), records.of_tensor(f, t))
    return out


def _module_copies(
    ckpt: ZeroCheckpoint, model0: LoadedFile, trained: set[str], records: _Records
) -> list[ModuleCopy]:
    module = model0.obj.get("module")
    if not isinstance(module, Mapping):
        return []
    file_index = records.urls.index(model0.url)
    out = []
    for name in ckpt.module_order:
        t = module.get(name)
        if name in trained or not isinstance(t, TensorRecord):
            continue
        if not t.is_contiguous():
            raise UnsupportedCheckpointError(
                f"{model0.url}: module tensor '{name}' is not contiguous; `--to universal` "
                "of it is not supported yet"
            )
        offset = model0.zip.tensor_offset(t) if t.numel else 0
        record = records.of_tensor(model0, t) if t.numel else -1
        out.append(
            ModuleCopy(name=name, shape=tuple(t.shape), dtype=t.dtype,
                       run=Run(file_index, offset, t.numel, record))
        )  # fmt: skip
    return out


def _optimizer_state(
    ckpt: ZeroCheckpoint, osd: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[int, Any]]:
    """`optimizer_state.pt`'s object and (ZeRO-1/2) each group's step."""
    if ckpt.stage < 3:
        base = osd["base_optimizer_state"]
        out = {k: v for k, v in osd.items() if k not in _Z12_DROPPED}
        out["param_groups"] = base["param_groups"]
        state = _state_of(ckpt.optim_files[0], ckpt.stage)
        steps = {
            int(g): entry["step"]
            for g, entry in state.items()
            if isinstance(entry, Mapping) and "step" in entry
        }
        return out, steps
    inner = osd["optimizer_state_dict"]
    state = _state_of(ckpt.optim_files[0], 3)
    lean_state = {
        g: {k: v for k, v in entry.items() if not (isinstance(v, TensorRecord) and v.shape)}
        for g, entry in state.items()
        if isinstance(entry, Mapping)
    }
    lean_inner = {**inner, "state": lean_state}
    out = {k: v for k, v in osd.items() if k != "fp32_flat_groups"}
    out["optimizer_state_dict"] = lean_inner
    out["param_groups"] = inner["param_groups"]
    return out, {}


def small_tensors(obj: Any) -> list[TensorRecord]:
    """Every `TensorRecord` in `obj` (containers and inert objects walked).

    Raises:
        UnsupportedCheckpointError: For one larger than a small state tensor should be.
    """
    found: list[TensorRecord] = []

    def walk(o: Any) -> None:
        if isinstance(o, TensorRecord):
            if o.nbytes > _SMALL_TENSOR_BYTES:
                raise UnsupportedCheckpointError(
                    f"optimizer_state.pt would hold a {o.nbytes}-byte tensor {list(o.shape)}; "
                    "only small state (steps, scalars) is expected there"
                )
            found.append(o)
        elif isinstance(o, Mapping):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif isinstance(o, InertObject):
            walk(o.args)
            walk(o.state)

    walk(obj)
    return found
