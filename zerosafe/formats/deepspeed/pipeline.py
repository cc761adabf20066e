"""DeepSpeed pipeline-parallel checkpoints (`PipelineModule` + `PipelineEngine`, ZeRO stage 0 or 1).

DeepSpeed `runtime/pipe/module.py`, `runtime/pipe/engine.py`, `runtime/engine.py`
`save_checkpoint`; docs/formats.md, "Model-parallel ranks". The checkpoint's `mp_rank_XX` is
the pipeline stage (the `PipelineParallelGrid` model group is every stage of one data-parallel
replica, so `mp_world_size` is the number of stages, and DeepSpeed 0.19 also records
`checkpoint_parallel_dimensions: {pp_degree, tp_degree}`). Each stage is a ZeRO-1
data-parallel group of its own: `[bf16_]zero_pp_rank_{d}_mp_rank_{s}_optim_states.pt` holds
rank d's partition of stage s's masters, `mp_rank_{s}_model_states.pt` the stage's
`param_shapes` (names as in that stage's `PipelineModule`: `tied_modules.<key>.…` for a
`TiedLayerSpec`, `<layer index>.…` for the others), `buffer_names` and `module=None`. The
module's tensors are in `layer_{i:02d}-model_states.pt`, one per layer that has a
`state_dict` (`PipelineModule.save_state_dict`), keyed as in the layer (`weight`, `up.bias`):
the only copy of buffers and frozen params. A tied module is trained on every stage that uses
it, so its params are in the masters of each of those stages; DeepSpeed keeps the copies
equal (their gradients are all-reduced across the stages), and the conversion takes the first
stage's. The output is the union of the stages, named as the stages' `state_dict()`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

from zerosafe.errors import CheckpointFormatError, LayoutMismatchError, UnsupportedCheckpointError
from zerosafe.formats.base import InspectFacts, SourceLayout, SourceTensor
from zerosafe.formats.deepspeed.facts import source_block, zero_facts
from zerosafe.formats.deepspeed.files import load_all
from zerosafe.formats.deepspeed.model_parallel import parallel_dims, tensor_parallel_refusal
from zerosafe.formats.deepspeed.rank_files import open_rank_files
from zerosafe.formats.deepspeed.save_identity import (
    check_module_copy_sample,
    check_one_save,
    lowp_copy_missing,
)
from zerosafe.formats.deepspeed.slots import SlotBuilder, metadata_bytes_of, zero12_fragments
from zerosafe.formats.deepspeed.types import (
    LayerTensor,
    LoadedFile,
    PipelineCheckpoint,
    TagFiles,
    ZeroCheckpoint,
)
from zerosafe.formats.torch_zip import TensorRecord
from zerosafe.io.storage import Storage

if TYPE_CHECKING:
    from zerosafe.config import ConvertOptions
    from zerosafe.plan.model import Plan

__all__ = ["LayerTensor", "PipelineCheckpoint", "open_pipeline", "pipeline_layout", "stage_summary"]

TIED_PREFIX = "tied_modules."
"""Where `PipelineModule` registers the modules of `TiedLayerSpec`s."""
TIED_SAMPLE_ELEMENTS = 16
"""Elements of each stage's copy of a tied param compared with the converted one."""


def open_pipeline(
    storage: Storage, ckpt_url: str, tag: str, found: TagFiles, max_workers: int = 8
) -> PipelineCheckpoint:
    """Read a pipeline-parallel tag folder: every stage as a `ZeroCheckpoint`, the layer
    files named, each tensor's source chosen.

    Raises:
        UnsupportedCheckpointError: Pipeline combined with tensor parallelism.
        CheckpointFormatError: A stage's files missing, or a layer file that is no state dict.
        LayoutMismatchError: Stages or layer files from different runs or saves.
    """
    tag_url = found.tag_url
    mps = sorted({*found.optim, *found.model})
    jobs = [
        (url, role, rank)
        for mp in mps
        for role, files in (("optim", found.optim.get(mp, {})), ("model", found.model.get(mp, {})))
        for rank, url in files.items()
    ] + [(url, "layer", 0) for url in found.layers.values()]
    loaded = load_all(storage, jobs, max_workers)
    model0 = loaded[found.model[0][min(found.model[0])]]
    pp, tp = parallel_dims(model0)
    if tp is not None and tp > 1:
        raise tensor_parallel_refusal(
            model0.url, 1, f"pipeline parallelism combined with tensor parallelism (tp_degree={tp})"
        )
    mp_world_size = model0.obj.get("mp_world_size")
    stages = pp or (mp_world_size if isinstance(mp_world_size, int) else None) or len(mps)
    missing = [s for s in range(stages) if not found.optim.get(s) or not found.model.get(s)]
    if missing:
        s = missing[0]
        lacking = (
            f"[bf16_]zero_pp_rank_*_mp_rank_{s:02d}_optim_states.pt"
            if not found.optim.get(s)
            else f"mp_rank_{s:02d}_model_states.pt"
        )
        raise CheckpointFormatError(
            f"{tag_url}: pipeline stage {s}'s files are missing ({lacking}); "
            f"{model0.url.rsplit('/', 1)[-1]} says the model was split into {stages} pipeline "
            f"stages (mp_rank_00..mp_rank_{stages - 1:02d}). Copy the whole tag folder."
        )
    extra = [mp for mp in mps if mp >= stages]
    if extra:
        raise LayoutMismatchError(
            f"{tag_url}: stale files of pipeline stage(s) {extra} (mp_rank_{extra[0]:02d}); "
            f"this checkpoint has {stages} stages, so they come from another run. Move them "
            "out of the tag folder and run again."
        )
    stage_ckpts = []
    for s in range(stages):
        optim = {r: loaded[u] for r, u in sorted(found.optim[s].items())}
        model = {r: loaded[u] for r, u in sorted(found.model[s].items())}
        stage_ckpts.append(
            open_rank_files(
                ckpt_url,
                tag,
                tag_url,
                storage,
                optim,
                model,
                pipeline_stage=s,
                model_parallel=stages,
            )  # fmt: skip
        )
    _check_stages_agree(tag_url, stage_ckpts)
    check_one_save(
        tag_url,
        [f for z in stage_ckpts for f in z.optim_files],
        [f for z in stage_ckpts for f in z.model_files],
    )
    layer_files = [loaded[found.layers[i]] for i in sorted(found.layers)]
    return _assemble(
        ckpt_url,
        tag,
        tag_url,
        stage_ckpts,
        dict(zip(sorted(found.layers), layer_files, strict=True)),
    )


def _check_stages_agree(tag_url: str, stages: list[ZeroCheckpoint]) -> None:
    first = stages[0]
    if first.stage != 1:
        raise LayoutMismatchError(
            f"{first.optim_files[0].url}: ZeRO stage {first.stage} optimizer files beside "
            "pipeline layer files; DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only, so "
            "files from different runs are mixed"
        )
    for s, z in enumerate(stages[1:], start=1):
        for what, a, b in (
            ("ZeRO stage / optimizer", (first.stage, first.optimizer_kind), (z.stage, z.optimizer_kind)),
            ("data-parallel world size", first.world_size, z.world_size),
            ("master dtype", first.master_dtype, z.master_dtype),
            ("training dtype", first.train_dtype, z.train_dtype),
        ):  # fmt: skip
            if a != b:
                raise LayoutMismatchError(
                    f"{tag_url}: pipeline stage {s} has {what} {b!r} but stage 0 has {a!r}; "
                    "files from different runs are mixed"
                )


def _layer_tensors(f: LoadedFile) -> dict[str, TensorRecord]:
    out = {}
    for key, t in f.obj.items():
        if not isinstance(key, str) or not isinstance(t, TensorRecord):
            raise CheckpointFormatError(
                f"{f.url}: expected a layer's state_dict (names -> tensors), found {key!r}: "
                f"{type(t).__name__}"
            )
        out[key] = t
    return out


def _assemble(
    ckpt_url: str,
    tag: str,
    tag_url: str,
    stages: list[ZeroCheckpoint],
    layers: dict[int, LoadedFile],
) -> PipelineCheckpoint:
    """Name the layer files' tensors, and pick each tensor's source."""
    shapes: dict[str, tuple[int, ...]] = {}
    held_by: dict[str, list[int]] = {}
    for s, z in enumerate(stages):
        for group in z.param_groups:
            for name, shape in group:
                if name in shapes and shapes[name] != shape:
                    raise LayoutMismatchError(
                        f"{z.model_files[0].url}: param '{name}' has shape {list(shape)} on "
                        f"stage {s} but {list(shapes[name])} on stage {held_by[name][0]}; "
                        "files from different runs are mixed"
                    )
                shapes[name] = shape
                held_by.setdefault(name, []).append(s)
    buffer_stage: dict[str, int] = {}
    for s, z in enumerate(stages):
        for name in z.model_files[0].obj.get("buffer_names") or []:
            buffer_stage.setdefault(str(name), s)
    known = set(shapes) | set(buffer_stage)
    named = _name_layer_files(layers, known, shapes)
    by_name: dict[str, LayerTensor] = {}
    position: dict[str, tuple[int, int]] = {}
    for idx, tensors in named.items():
        for i, lt in enumerate(tensors):
            by_name.setdefault(lt.name, lt)
            position.setdefault(lt.name, (idx, i))
    ckpt = PipelineCheckpoint(
        ckpt_url=ckpt_url, tag=tag, tag_url=tag_url, stages=stages,
        layer_files=list(layers.values()), owner={n: h[0] for n, h in held_by.items()},
        held_by=held_by, buffers=[], frozen=[], empty_params=[], shared={}, order=[],
        module_copies={n: by_name[n] for n in shapes if n in by_name},
    )  # fmt: skip
    for z in stages:
        ckpt.notes += [n for n in z.notes if n not in ckpt.notes]
        ckpt.warnings += [w for w in z.warnings if w not in ckpt.warnings]
        ckpt.empty_params += z.empty_params
        ckpt.shared.update(z.shared)
    missing_buffers = []
    for name in buffer_stage:
        if name in by_name:
            ckpt.buffers.append(by_name[name])
        else:
            missing_buffers.append(name)
    for name, lt in by_name.items():
        if name in shapes or name in buffer_stage:
            continue
        if lt.tensor.numel == 0:
            ckpt.empty_params.append((name, tuple(lt.tensor.shape), lt.tensor.dtype))
        else:
            ckpt.frozen.append(lt)
    for lt in (*ckpt.buffers, *ckpt.frozen):
        if lt.tensor.numel and not lt.tensor.is_contiguous():
            raise CheckpointFormatError(f"{lt.file.url}: tensor '{lt.name}' is not contiguous")
    owners = set(shapes) | {lt.name for lt in ckpt.frozen} | {n for n, _, _ in ckpt.empty_params}
    for alias, target in ckpt.shared.items():
        if target not in owners:
            raise LayoutMismatchError(
                f"{tag_url}: tied param '{alias}' shares memory with '{target}', which is "
                "neither a trained nor a frozen param of this checkpoint"
            )
    ckpt.order = _output_order(ckpt, shapes, buffer_stage, position)
    _pipeline_notes(ckpt, missing_buffers)
    return ckpt


def _name_layer_files(
    layers: dict[int, LoadedFile], known: set[str], shapes: dict[str, tuple[int, ...]]
) -> dict[int, list[LayerTensor]]:
    """Each layer file's tensors under their `PipelineModule.state_dict()` names.

    Layer i is registered as module `str(i)` unless it is a `TiedLayerSpec`, whose module is
    `tied_modules.<key>`: a file none of whose keys is known as `i.<key>` (a trained param or
    a buffer of some stage) is the tied module whose known names hold its keys. A file that
    matches neither holds frozen params only, as `i.<key>`.
    """
    tied: dict[str, set[str]] = {}
    for name in known:
        if name.startswith(TIED_PREFIX):
            module, _, sub = name[len(TIED_PREFIX) :].partition(".")
            tied.setdefault(module, set()).add(sub)
    out: dict[int, list[LayerTensor]] = {}
    for idx, f in layers.items():
        tensors = _layer_tensors(f)
        if any(f"{idx}.{k}" in known for k in tensors):
            prefix = f"{idx}."
        else:
            fits = [
                m
                for m, subs in tied.items()
                if any(k in subs for k in tensors)
                and all(
                    f"{TIED_PREFIX}{m}.{k}" not in shapes
                    or shapes[f"{TIED_PREFIX}{m}.{k}"] == tuple(t.shape)
                    for k, t in tensors.items()
                )
            ]
            if len(fits) > 1:
                raise UnsupportedCheckpointError(
                    f"{f.url}: the tensors of layer {idx} ({', '.join(tensors)}) fit the tied "
                    f"modules {', '.join(TIED_PREFIX + m for m in sorted(fits))} alike; the "
                    "checkpoint does not say which TiedLayerSpec this layer is, so its "
                    "buffers and frozen params cannot be named"
                )
            prefix = f"{TIED_PREFIX}{fits[0]}." if fits else f"{idx}."
        out[idx] = [LayerTensor(name=prefix + k, file=f, tensor=t) for k, t in tensors.items()]
        for lt in out[idx]:
            want = shapes.get(lt.name)
            if want is not None and want != tuple(lt.tensor.shape):
                raise LayoutMismatchError(
                    f"{f.url}: '{lt.name}' has shape {list(lt.tensor.shape)} but the stage's "
                    f"'param_shapes' says {list(want)}; the layer files come from another run"
                )
    return out


def _output_order(
    ckpt: PipelineCheckpoint,
    shapes: dict[str, tuple[int, ...]],
    buffer_stage: dict[str, int],
    position: dict[str, tuple[int, int]],
) -> list[str]:
    """The union of the stages' `state_dict()` orders: tied modules first (`PipelineModule`
    registers them before the layers), then the layers by index, each in its file's order."""
    names: list[str] = []
    for s, z in enumerate(ckpt.stages):
        names += [n for n in z.param_names if ckpt.owner[n] == s]
    names += list(buffer_stage)
    names += [lt.name for lt in ckpt.frozen] + [n for n, _, _ in ckpt.empty_params]
    names += list(ckpt.shared)
    fallback = {n: i for i, n in enumerate(dict.fromkeys(names))}

    def key(name: str) -> tuple[int, int, int, int]:
        if name in position:
            idx, i = position[name]
        else:
            head = name.partition(".")[0]
            idx, i = (int(head) if head.isdigit() else -1), 10**9
        if name.startswith(TIED_PREFIX):
            return (0, 0, i, fallback[name])
        return (1, idx, i, fallback[name])

    return sorted(fallback, key=key)


def _layer_label(name: str) -> str:
    if name.startswith(TIED_PREFIX):
        return TIED_PREFIX + name[len(TIED_PREFIX) :].partition(".")[0]
    return name.partition(".")[0]


def stage_summary(ckpt: PipelineCheckpoint) -> list[dict[str, Any]]:
    """Per stage: its files' `mp_rank`, the layers (module names) it holds, its trained params."""
    out = []
    for s, z in enumerate(ckpt.stages):
        params = z.param_names
        labels = list(dict.fromkeys(_layer_label(n) for n in params))
        out.append(
            {
                "stage": s,
                "mp_rank": f"mp_rank_{s:02d}",
                "modules": labels,
                "params": params,
                "numel": sum(math.prod(shape) for g in z.param_groups for _, shape in g),
            }
        )
    return out


def _pipeline_notes(ckpt: PipelineCheckpoint, missing_buffers: list[str]) -> None:
    ckpt.notes.append(
        f"pipeline-parallel checkpoint (DeepSpeed PipelineModule): {ckpt.num_stages} stages "
        f"(mp_rank_00..mp_rank_{ckpt.num_stages - 1:02d}), each its own ZeRO-1 group of "
        f"{ckpt.world_size} rank(s); the output is the union of the stages' masters, buffers "
        f"and frozen params from {len(ckpt.layer_files)} layer files, named as the stages' "
        "PipelineModule.state_dict() (DeepSpeed's zero_to_fp32 cannot read pipeline checkpoints)"
    )
    for name, stages in ckpt.held_by.items():
        if len(stages) > 1:
            ckpt.notes.append(
                f"'{name}' is held by stages {', '.join(map(str, stages))} (a TiedLayerSpec "
                f"trained on each): converted from stage {stages[0]}'s masters; DeepSpeed keeps "
                "the copies equal (it all-reduces their gradients across the stages), and the "
                f"first {TIED_SAMPLE_ELEMENTS} elements of every copy were compared"
            )
    if missing_buffers:
        ckpt.notes.append(
            f"{len(missing_buffers)} buffer(s) are in no layer file (a layer DeepSpeed saves "
            "no state_dict of, such as a TiedLayerSpec with forward_fn): not converted: "
            + ", ".join(missing_buffers)
        )
    if ckpt.frozen:
        ckpt.notes.append(
            f"{len(ckpt.frozen)} frozen param(s) taken from the {ckpt.train_dtype} layer files "
            "(ZeRO-1 keeps no fp32 copy of them): " + ", ".join(lt.name for lt in ckpt.frozen)
        )


# ---------------------------------------------------------------------------------------------
# Layout


def pipeline_layout(ckpt: PipelineCheckpoint, options: ConvertOptions) -> SourceLayout:
    """Slots and fragments of every tensor of a pipeline-parallel checkpoint: each stage's
    masters as in a ZeRO-1 checkpoint, buffers and frozen params from the layer files."""
    builder = SlotBuilder(ckpt)  # type: ignore[arg-type]
    tensors: dict[str, SourceTensor] = {}
    copies: dict[str, list[tuple[int, tuple[int, int, int, int]]]] = {}
    for s, z in enumerate(ckpt.stages):
        fp32_slot = {
            (f.rank, g): builder.add(f, "fp32", f"stage{s}/fp32/group{g}", t)
            for f in z.optim_files
            for g, t in enumerate(z.fp32_partitions[f.rank])
        }
        fragments: dict[str, list[tuple[int, int, int, int]]] = {}
        zero12_fragments(z, fp32_slot, fragments)
        for group in z.param_groups:
            for name, shape in group:
                frags = tuple(fragments.get(name, ()))
                if frags:
                    copies.setdefault(name, []).append((s, frags[0]))
                if ckpt.owner[name] != s:
                    continue
                tensors[name] = SourceTensor(
                    name=name, shape=shape, dtype=z.master_dtype, role="param", fragments=frags
                )
    for name, shape, dtype in ckpt.empty_params:
        tensors[name] = SourceTensor(
            name=name, shape=shape, dtype=dtype, role="param", fragments=()
        )
    frozen = ckpt.frozen if not options.exclude_frozen else []
    for lt, role in [*((lt, "frozen") for lt in frozen), *((lt, "buffer") for lt in ckpt.buffers)]:
        t = lt.tensor
        frags = ()
        if t.numel:
            frags = ((builder.add(lt.file, role, f"{role}/{lt.name}", t), 0, t.numel, 0),)
        tensors[lt.name] = SourceTensor(
            name=lt.name, shape=tuple(t.shape), dtype=t.dtype, role=role, fragments=frags
        )
    files, slots = _global_ranks(ckpt, builder.files, builder.resolve())
    source = source_block(ckpt, pipeline_stages=ckpt.num_stages)  # type: ignore[arg-type]
    facts = zero_facts(ckpt)  # type: ignore[arg-type]
    _pipeline_facts(ckpt, facts)
    layout = SourceLayout(
        format="deepspeed", where=ckpt.tag_url, tag=ckpt.tag, files=files, slots=slots,
        tensors=tensors, order=list(ckpt.order), aliases=dict(ckpt.shared),
        source=source, facts=facts,
        metadata_bytes=metadata_bytes_of(ckpt.files),
        notes=list(ckpt.notes), warnings=list(ckpt.warnings),
        checks=(
            functools.partial(check_module_copy_sample, ckpt),
            functools.partial(_check_tied_copies, ckpt, copies),
        ),
        native=ckpt, lowp_missing=lowp_copy_missing(ckpt),
    )  # fmt: skip
    if options.exclude_frozen:
        for lt in ckpt.frozen:
            layout.tensors[lt.name] = SourceTensor(
                name=lt.name, shape=tuple(lt.tensor.shape), dtype=lt.tensor.dtype,
                role="frozen", fragments=(),
            )  # fmt: skip
    return layout


def _global_ranks(
    ckpt: PipelineCheckpoint, files: list[Any], slots: list[Any]
) -> tuple[list[Any], list[Any]]:
    """Files and slots with the global rank that wrote them (`PipeDataParallelTopology`:
    stage * data-parallel size + data-parallel rank; layer files: the stage's rank 0), so
    staged extraction groups them by the rank they came from."""
    rank_of: dict[str, int] = {}
    for s, z in enumerate(ckpt.stages):
        for f in z.files:
            rank_of[f.url] = s * ckpt.world_size + f.rank
    on_stage = [
        set(z.param_names) | {str(n) for n in z.model_files[0].obj.get("buffer_names") or ()}
        for z in ckpt.stages
    ]
    stage_of_layer: dict[str, int] = {}
    for lt in (*ckpt.buffers, *ckpt.frozen, *ckpt.module_copies.values()):
        stage = next((s for s, names in enumerate(on_stage) if lt.name in names), None)
        if stage is not None:
            stage_of_layer.setdefault(lt.file.url, stage)
    for f in ckpt.layer_files:
        rank_of[f.url] = stage_of_layer.get(f.url, 0) * ckpt.world_size
    files = [dataclasses.replace(f, rank=rank_of.get(f.url, f.rank)) for f in files]
    slots = [dataclasses.replace(s, rank=files[s.file].rank) for s in slots]
    return files, slots


def _pipeline_facts(ckpt: PipelineCheckpoint, facts: InspectFacts) -> None:
    stages = stage_summary(ckpt)
    tied = {n: h for n, h in ckpt.held_by.items() if len(h) > 1}
    facts.appendix["pipeline"] = {
        "stages": ckpt.num_stages,
        "layer_files": len(ckpt.layer_files),
        "params_by_stage": [s["params"] for s in stages],
        "tied_across_stages": tied,
    }
    lines = [
        f"  pipeline parallel: {ckpt.num_stages} stages (mp_rank_00..mp_rank_"
        f"{ckpt.num_stages - 1:02d}, DeepSpeed PipelineModule), {len(ckpt.layer_files)} layer files"
    ]
    for s in stages:
        lines.append(
            f"    stage {s['stage']}: {len(s['params'])} trained params, {s['numel']:,} elements, "
            f"modules {', '.join(s['modules'])}"
        )
    for name, held in tied.items():
        lines.append(
            f"    tied across stages: {name} on stages {', '.join(map(str, held))} "
            f"(converted from stage {held[0]})"
        )
    about = facts.about
    about[2:2] = lines
    files_line = next(i for i, line in enumerate(about) if line.startswith("  files: "))
    about[files_line] = about[files_line].replace(
        " model states", f" model states + {len(ckpt.layer_files)} layer files", 1
    )
    files = facts.fields["files"]
    assert isinstance(files, dict)
    files["layer_files"] = len(ckpt.layer_files)


def _check_tied_copies(
    ckpt: PipelineCheckpoint,
    copies: dict[str, list[tuple[int, tuple[int, int, int, int]]]],
    plan: Plan,
) -> None:
    """Each stage's copy of a param held by several stages starts with the same elements as
    the converted one (a few bytes read per copy).

    Raises:
        LayoutMismatchError: Naming the param and the stages that disagree.
    """
    by_url = {f.url: f for f in ckpt.files}
    for name, held in copies.items():
        if len(held) < 2:
            continue
        samples = []
        for s, (slot_index, src_offset, numel, dst_offset) in held:
            if dst_offset != 0:
                break
            slot = plan.slots[slot_index]
            count = min(numel, TIED_SAMPLE_ELEMENTS)
            start = slot.byte_offset + src_offset * slot.itemsize
            f = by_url[plan.files[slot.file].url]
            samples.append((s, f, f.zip.source.read_range(start, start + count * slot.itemsize)))
        if len(samples) < 2:
            continue
        n = min(len(raw) for _, _, raw in samples)
        s0, f0, raw0 = samples[0]
        for s, f, raw in samples[1:]:
            if raw[:n] != raw0[:n]:
                raise LayoutMismatchError(
                    f"{f.url}: stage {s}'s master copy of the tied param '{name}' differs from "
                    f"stage {s0}'s in {f0.url.rsplit('/', 1)[-1]}, which DeepSpeed keeps equal; "
                    "the stages' files come from different saves (steps or runs). Copy the "
                    "whole tag folder of one save again."
                )
