"""Check that every rank file of a ZeRO tag comes from one and the same save.

A tag folder whose files were copied together from two saves (rank 1's files from
`global_step2` dropped into `global_step4`) has the right names, shapes and partition counts,
so nothing else catches it, and the output would silently mix two steps. The files carry
what tells one save from another, all of it in the pickles, so checking costs no extra read:

- every per-rank model states file (ZeRO-3) records `global_steps`, `global_samples`,
  `skipped_steps`, `ds_version` and `ds_config`;
- every optimizer file records `ds_version` and `ds_config`, the optimizer's hyperparameters
  per param group (the learning rate moves with a schedule), and the step count each param
  group's state has taken (`state[i]["step"]`). The step is a one-element tensor; the CRC-32
  of its zip record is a fingerprint of its value, read from the zip directory alone (for a
  4-byte value CRC-32 is one-to-one).

Files of one save agree on all of these. The check compares each field across the files of
a role and names the file(s) out of step with the majority.

ZeRO-1/2 keep one model states file for all ranks, so a model states file copied from another
step agrees with itself. But it holds the module's own copy of every trained weight (16-bit,
or fp32 in fp32 training), which DeepSpeed refreshes from the fp32 masters after each step:
`check_module_copy_sample` compares a few elements of a few params, cast as DeepSpeed casts,
with the masters (a few hundred bytes read), and refuses a mismatch. MoE expert files hold
the same copy of each expert's weights; one expert of every expert-parallel rank is sampled
too, which also checks that zerosafe read the expert-parallel topology the model trained with.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zerosafe.errors import LayoutMismatchError
from zerosafe.formats.deepspeed.types import LoadedFile, PipelineCheckpoint, ZeroCheckpoint
from zerosafe.formats.torch_pickle import InertObject, TensorRecord

if TYPE_CHECKING:
    from zerosafe.plan.model import Plan

__all__ = ["check_module_copy_sample", "check_one_save", "lowp_copy_missing", "module_copies"]

SAMPLE_PARAMS = 8
"""Params the module-copy sample looks at (the first ones of the flat layout)."""
SAMPLE_ELEMENTS = 16
"""Elements of each."""
SAMPLE_EXPERTS = 16
"""MoE: expert files the sample looks at (the first expert of each expert-parallel rank)."""

_MODEL_FIELDS = ("global_steps", "global_samples", "skipped_steps", "ds_version", "ds_config")


def lowp_copy_missing(ckpt: ZeroCheckpoint | PipelineCheckpoint) -> str | None:
    """Why `ckpt` keeps no 16-bit copy of its trained params for `check_lowp` to compare
    with, or None where it keeps one (ZeRO-1/2 trained in bf16 or fp16)."""
    if ckpt.stage == 3:
        return "ZeRO-3 saves no 16-bit copy of trained params"
    if ckpt.train_dtype == "float32":
        return "trained in fp32: the module copy is the same fp32 data"
    return None


def _canonical(value: Any) -> str:
    def default(o: Any) -> Any:
        if isinstance(o, InertObject):
            return repr(o)
        return str(o)

    return json.dumps(value, sort_keys=True, default=default)


def _base_state(osd: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The wrapped torch optimizer's `state_dict()`: ZeRO-3 nests it as `optimizer_state_dict`,
    ZeRO-1/2 and BF16_Optimizer as `base_optimizer_state`."""
    for key in ("optimizer_state_dict", "base_optimizer_state"):
        inner = osd.get(key)
        if isinstance(inner, Mapping):
            return inner
    return None


def _step_fingerprint(f: LoadedFile, value: Any) -> Any:
    if isinstance(value, TensorRecord):
        record = f.zip.storage_record(value.storage.key)
        if record.has_crc or value.nbytes > 64:
            return f"a {value.dtype} tensor whose zip record has CRC-32 {record.crc32:08x}"
        # A legacy (non-zip) file keeps no CRCs: the step is a few bytes, read them.
        return f"a {value.dtype} tensor holding {f.zip.read_tensor_bytes(value).hex()}"
    return repr(value)


def _optim_fields(f: LoadedFile) -> dict[str, Any]:
    osd = f.obj.get("optimizer_state_dict")
    fields: dict[str, Any] = {
        "ds_version": f.obj.get("ds_version"),
        "ds_config": f.obj.get("ds_config"),
    }
    base = _base_state(osd) if isinstance(osd, Mapping) else None
    if base is None:
        return fields
    state = base.get("state")
    if isinstance(state, Mapping):
        steps = []
        for key in sorted(state, key=str):
            entry = state[key]
            if isinstance(entry, Mapping) and "step" in entry:
                steps.append(_step_fingerprint(f, entry["step"]))
        # One value per file when all groups stepped together (the usual case).
        fields["optimizer step count"] = sorted(set(steps)) if len(set(steps)) == 1 else steps
    groups = base.get("param_groups")
    if isinstance(groups, Sequence):
        rows = [
            {k: v for k, v in g.items() if k != "params"} if isinstance(g, Mapping) else g
            for g in groups
        ]
        if any(isinstance(g, Mapping) and g.get("moe") for g in groups):
            # DeepSpeed orders the expert groups of several expert-parallel sizes by iterating
            # a set of names, so ranks of one save can list them in different orders.
            rows.sort(key=_canonical)
        fields["optimizer hyperparameters (lr schedule)"] = rows
    return fields


def _model_fields(f: LoadedFile) -> dict[str, Any]:
    return {k: f.obj.get(k) for k in _MODEL_FIELDS}


def _shown(value: Any) -> str:
    text = _canonical(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _compare(tag_url: str, files: Sequence[LoadedFile], fields_of: Callable[..., Any]) -> None:
    if len(files) < 2:
        return
    rows = [(f, fields_of(f)) for f in files]
    for field in rows[0][1]:
        values = [_canonical(r.get(field)) for _, r in rows]
        if len(set(values)) == 1:
            continue
        common, count = Counter(values).most_common(1)[0]
        if count * 2 <= len(values):  # no majority: name the first file that differs
            common = values[0]
        odd = [f for (f, _), v in zip(rows, values, strict=True) if v != common]
        ref = next(f for (f, _), v in zip(rows, values, strict=True) if v == common)
        names = ", ".join(o.url.rsplit("/", 1)[-1] for o in odd)
        raise LayoutMismatchError(
            f"{tag_url}: the rank files come from different saves: {names} "
            f"{'has' if len(odd) == 1 else 'have'} {field} {_shown(fields_of(odd[0])[field])}, "
            f"but {ref.url.rsplit('/', 1)[-1]} has {_shown(fields_of(ref)[field])}. Files copied "
            "from another step or run are mixed into this tag folder; copy the whole tag folder "
            "of one save again."
        )


def check_one_save(
    tag_url: str, optim_files: Sequence[LoadedFile], model_files: Sequence[LoadedFile]
) -> None:
    """Refuse a tag folder whose rank files come from more than one save.

    Raises:
        LayoutMismatchError: Naming the odd file(s) out and the field they disagree on.
    """
    _compare(tag_url, model_files, _model_fields)
    _compare(tag_url, optim_files, _optim_fields)
    # One model states file (ZeRO-1/2) against the optimizer files: the save's config.
    for field in ("ds_version", "ds_config"):
        if model_files and optim_files and field in model_files[0].obj:
            model_value = model_files[0].obj.get(field)
            for f in optim_files:
                if field in f.obj and _canonical(f.obj[field]) != _canonical(model_value):
                    raise LayoutMismatchError(
                        f"{tag_url}: {f.url.rsplit('/', 1)[-1]} has {field} "
                        f"{_shown(f.obj[field])}, but {model_files[0].url.rsplit('/', 1)[-1]} has "
                        f"{_shown(model_value)}; files from different saves are mixed. Copy the "
                        "whole tag folder of one save again."
                    )


def module_copies(
    ckpt: ZeroCheckpoint | PipelineCheckpoint,
) -> dict[str, list[tuple[LoadedFile, TensorRecord, int]]]:
    """The training-dtype copies ZeRO-1/2 saves of each param beside its master: name ->
    `(file, tensor, element offset in the param)`: the model states' `module`, the MoE expert
    files (an AutoEP expert file holds one expert's rows of a fused weight), or the layer
    files of a pipeline-parallel checkpoint."""
    if isinstance(ckpt, PipelineCheckpoint):  # trained params, in their layer files
        return {name: [(lt.file, lt.tensor, 0)] for name, lt in ckpt.module_copies.items()}
    if ckpt.stage == 3 or not ckpt.model_files:
        return {}  # ZeRO-3 keeps no module copy of partitioned params
    model = ckpt.model_files[0]
    module = model.obj.get("module")
    out: dict[str, list[tuple[LoadedFile, TensorRecord, int]]] = {
        str(name): [(model, t, 0)]
        for name, t in (module.items() if isinstance(module, Mapping) else ())
        if isinstance(t, TensorRecord)
    }
    if ckpt.moe is not None:
        for name, copies in ckpt.moe.copies.items():
            out.setdefault(name, []).extend(copies)
    return out


def _expert_samples(
    ckpt: ZeroCheckpoint | PipelineCheckpoint,
) -> list[tuple[str, LoadedFile, TensorRecord, int]]:
    """`(param, expert file, tensor, offset)` of the first expert of every expert-parallel
    rank of every MoE layer, at most `SAMPLE_EXPERTS`, expert-parallel ranks first."""
    moe = ckpt.moe  # None for a PipelineCheckpoint: MoE with pipelines is refused
    if moe is None or ckpt.stage == 3:
        return []
    by_file: dict[str, tuple[str, LoadedFile, TensorRecord, int]] = {}
    for name, copies in moe.copies.items():
        for f, t, offset in copies:
            by_file.setdefault(f.url.rsplit("/", 1)[-1], (name, f, t, offset))
    wanted = []
    width = max((x.ep_size for x in moe.layers), default=0)
    for e in range(width):
        for layer in moe.layers:
            if e < layer.ep_size and layer.experts_of[e]:
                wanted.append(f"layer_{layer.layer_id}_expert_{layer.experts_of[e][0]}_")
    out = []
    for prefix in wanted[:SAMPLE_EXPERTS]:
        found = next((v for k, v in by_file.items() if k.startswith(prefix)), None)
        if found is not None:
            out.append(found)
    return out


_COPY_FILES = {"model": "model states file", "layer": "layer file", "expert": "expert file"}
"""What holds a module copy, by `LoadedFile.role`, in messages."""


def check_module_copy_sample(ckpt: ZeroCheckpoint | PipelineCheckpoint, plan: Plan) -> None:
    """ZeRO-1/2: the module's copy of the first params (in the model states, or a pipeline's
    layer files; and, with MoE, one expert file of every expert-parallel rank) must equal
    their fp32 masters, cast.

    Raises:
        LayoutMismatchError: Naming the model states (or layer, or expert) file, the param and
            the optimizer file.
    """
    copies = module_copies(ckpt)
    if not copies:
        return
    by_name = {t.name: t for t in plan.tensors if t.role == "param"}
    samples: list[tuple[str, LoadedFile, TensorRecord, int]] = []
    for tensor in plan.tensors:
        if len(samples) >= SAMPLE_PARAMS:
            break
        if tensor.role == "param" and copies.get(tensor.name):
            f, t, offset = copies[tensor.name][0]
            if f.role != "expert":  # experts: `_expert_samples`, one per expert-parallel rank
                samples.append((tensor.name, f, t, offset))
    samples += _expert_samples(ckpt)
    loaded = {f.url: f for f in ckpt.optim_files}
    for name, model, copy, offset in samples:
        spec = by_name.get(name)
        if spec is None or not copy.is_contiguous() or copy.numel == 0:
            continue
        if copy.dtype not in ("bfloat16", "float16", "float32"):
            continue
        fragment = next(
            (x for x in plan.fragments.for_tensor(spec.index) if x[3] <= offset < x[3] + x[2]),
            None,
        )
        if fragment is None:
            continue
        slot_index, src_offset, numel, dst_offset = fragment
        slot = plan.slots[slot_index]
        optim = loaded.get(plan.files[slot.file].url)
        if optim is None or slot.dtype not in ("bfloat16", "float16", "float32"):
            continue
        skip = offset - dst_offset
        count = min(numel - skip, SAMPLE_ELEMENTS, copy.numel)
        start = slot.byte_offset + (src_offset + skip) * slot.itemsize
        master = optim.zip.source.read_range(start, start + count * slot.itemsize)
        begin = model.zip.tensor_offset(copy)  # the copy starts at element `offset`
        saved = model.zip.source.read_range(begin, begin + count * copy.itemsize)
        if not _equal_cast(master, slot.dtype, saved, copy.dtype):
            what = _COPY_FILES.get(model.role, "model states file")
            hint = (
                ""
                if model.role != "expert"
                else ", or `use_data_before_expert_parallelism` in its ds_config is not the "
                "expert-parallel topology the model trained with"
            )
            raise LayoutMismatchError(
                f"{model.url}: its {copy.dtype} copy of '{name}' differs from the {slot.dtype} "
                f"master weights in {optim.url.rsplit('/', 1)[-1]}, which DeepSpeed keeps equal; "
                f"the {what} and the optimizer files come from different saves (steps or "
                f"runs){hint}. Copy the whole tag folder of one save again."
            )


def _equal_cast(master: bytes, master_dtype: str, saved: bytes, saved_dtype: str) -> bool:
    from zerosafe.cast import cast_bytes

    return cast_bytes(master, master_dtype, saved_dtype) == saved
