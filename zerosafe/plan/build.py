"""Plan a conversion from any format's `SourceLayout`: output tensors, shards, extract parts.

Format-agnostic: the reader has already turned the checkpoint into slots and fragments
(`zerosafe.formats.base`). Planning applies the options (which tensors, which dtype, tied
aliases written or recorded), checks that each tensor's fragments tile it, assigns tensors
to output files and, for staged mode, groups the slots into extract parts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

from zerosafe.config import ConvertOptions
from zerosafe.dtypes import dtype_info
from zerosafe.errors import CheckpointFormatError, ConfigError, LayoutMismatchError
from zerosafe.formats.base import Slot, SourceLayout, SourceTensor
from zerosafe.io.storage import Storage
from zerosafe.plan.adapter import (
    ADAPTER_WEIGHTS_NAME,
    adapter_layout,
    looks_like_adapter,
    read_adapter_config,
)
from zerosafe.plan.model import (
    PACKED_ROLE,
    SCALE_ROLE,
    ExtractPart,
    FragmentTable,
    Plan,
    ShardSpec,
    TensorSpec,
    job_key_of,
    shard_file_name,
)
from zerosafe.quantize import (
    BAND_BYTES_PER_COLUMN,
    FP4_GROUP,
    quantization_config,
    quantized_tensors,
)

__all__ = ["assign_shards", "output_dtype", "plan_checkpoint", "plan_layout", "plan_parts"]


def plan_checkpoint(
    storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
) -> tuple[SourceLayout, Plan]:
    """Detect the format of the checkpoint at `url`, read its metadata and plan converting it.
    Reads pickles and zip headers only, and the `config.json` of the model files the job
    copies (checked against the output: dtype, tied weights)."""
    from zerosafe.formats.registry import read_source
    from zerosafe.stages.model_files import model_files_report

    layout = read_source(storage, url, tag=tag, options=options)
    layout, adapter_warnings = _maybe_adapter(storage, layout, options)
    plan = plan_layout(layout, options)
    plan.warnings += adapter_warnings
    notes, warnings = model_files_report(
        storage, plan.source, options, aliases=layout.aliases, ties_by_config=layout.ties_by_config
    )
    plan.notes += notes
    plan.warnings += warnings
    return layout, plan


def _maybe_adapter(
    storage: Storage, layout: SourceLayout, options: ConvertOptions
) -> tuple[SourceLayout, list[str]]:
    """With `options.adapter`, the layout of the PEFT adapter the checkpoint holds
    (`zerosafe.plan.adapter`); without, a warning where the checkpoint looks like one."""
    from zerosafe.stages.model_files import model_files_folder

    folder = model_files_folder(layout.source, options)
    if options.adapter:
        if folder is None:
            raise ConfigError(
                "`--adapter` copies adapter_config.json with the adapter, but "
                "`--no-model-files` copies no file; drop `--no-model-files`, or pass "
                "`--model-files DIR` for the folder holding adapter_config.json"
            )
        config = read_adapter_config(storage, folder)
        return adapter_layout(layout, config, config_url=folder), []
    if folder is not None and storage.isdir(folder):
        if looks_like_adapter(layout, storage.listdir(folder)):
            return layout, [
                f"{layout.where}: holds a PEFT LoRA adapter (adapter_config.json in {folder}, "
                "every trained tensor a LoRA tensor); this output keeps the PeftModel's own "
                "names (with the adapter name, e.g. '.default'), which "
                "PeftModel.from_pretrained cannot load: convert with `--adapter` for "
                "adapter_model.safetensors"
            ]
    return layout, []


def plan_layout(layout: SourceLayout, options: ConvertOptions) -> Plan:
    """The plan of converting `layout` under `options`; no I/O.

    Raises:
        CheckpointFormatError: If two tensors would get one output name.
        LayoutMismatchError: If a tensor's fragments do not tile it exactly.
    """
    kept = _kept_tensors(layout, options)
    names, aliases = _output_names(layout, kept, options)
    _check_output_names(layout, names)
    owners = [layout.aliases.get(n, n) for n in names]
    dtypes = [output_dtype(layout.tensors[o], options) for o in owners]
    quantized = [
        options.quantize is not None
        and name == owner
        and options.quantize_skip_reason(name, layout.tensors[name].shape, d) is None
        for name, owner, d in zip(names, owners, dtypes, strict=True)
    ]
    scheme = options.quantize or ""
    stored = [
        quantized_tensors(scheme, n, layout.tensors[n].shape, options.quantize_scale_fmt)
        if q
        else [(n, d, ())]
        for n, d, q in zip(names, dtypes, quantized, strict=True)
    ]  # a quantized weight is stored as its values, then its scales
    sizes = [
        sum(math.prod(shape) * dtype_info(d).itemsize for _, d, shape in parts) if q
        else math.prod(layout.tensors[o].shape) * dtype_info(d).itemsize
        for o, d, q, parts in zip(owners, dtypes, quantized, stored, strict=True)
    ]  # fmt: skip  # a quantized weight and its scales go to one file: sized together
    # PEFT loads an adapter from one file: never sharded
    shard_of = [0] * len(sizes) if options.adapter else assign_shards(sizes, options.max_shard_size)
    specs: list[TensorSpec] = []
    for name, owner, dtype, shard, q, parts in zip(
        names, owners, dtypes, shard_of, quantized, stored, strict=True
    ):
        role = "tied" if owner != name else layout.tensors[name].role
        if q and parts[0][0] != name:
            role = PACKED_ROLE  # stored under another name (`weight_packed`)
        specs.append(
            TensorSpec(
                index=len(specs), name=parts[0][0] if q else name,
                shape=parts[0][2] if q else layout.tensors[owner].shape, role=role,
                src_dtype=layout.tensors[owner].dtype, out_dtype=parts[0][1] if q else dtype,
                shard=shard, alias_of=owner if owner != name else None,
            )
        )  # fmt: skip
        for scale, scale_dtype, scale_shape in parts[1:] if q else []:
            # its scales, written by the merge right after the weight (`zerosafe.quantize`)
            specs.append(
                TensorSpec(
                    index=len(specs), name=scale, shape=scale_shape, role=SCALE_ROLE,
                    src_dtype=scale_dtype, out_dtype=scale_dtype, shard=shard,
                )
            )  # fmt: skip
    fragments = FragmentTable.from_rows(list(_fragment_rows(layout, specs)))
    used_slots = sorted(set(fragments.slot.tolist()))
    plan = Plan(
        job_key=job_key_of(layout.tag, layout.identities, options),
        source=layout.source,
        options=options.identity(),
        files=layout.files,
        slots=layout.slots,
        tensors=specs,
        shards=_shard_specs(specs, adapter=options.adapter),
        parts=plan_parts(layout.slots, used_slots, options.extract_part_size),
        fragments=fragments,
        aliases=aliases,
        notes=[*layout.notes, *_option_notes(layout, specs, options)],
        warnings=[*layout.warnings, *_keep_fp32_warnings(layout, options)],
    )
    if options.quantize is not None:
        _plan_quantization(plan, layout, options)
    for check in layout.checks:
        check(plan)
    return plan


def output_dtype(tensor: SourceTensor, options: ConvertOptions) -> str:
    """Floating tensors take the output dtype, or float32 when their name matches a
    `keep_fp32` pattern; integer and bool tensors keep theirs."""
    if not dtype_info(tensor.dtype).is_floating:
        return tensor.dtype
    return "float32" if options.keeps_fp32(tensor.name) else options.dtype


def assign_shards(sizes: Sequence[int], max_shard_size: int) -> list[int]:
    """Greedy, in order: each tensor goes to the current file unless it would overflow a
    non-empty one. A tensor larger than `max_shard_size` gets a file of its own."""
    shard, filled, out = 0, 0, []
    for size in sizes:
        if filled and filled + size > max_shard_size:
            shard, filled = shard + 1, 0
        filled += size
        out.append(shard)
    return out


def plan_parts(slots: list[Slot], used: Iterable[int], part_bytes: int) -> list[ExtractPart]:
    """Group the used slots by rank into extract parts of at most `part_bytes` each (a slot
    larger than that is split across parts)."""
    by_rank: dict[int, list[Slot]] = {}
    for index in used:
        by_rank.setdefault(slots[index].rank, []).append(slots[index])
    parts: list[ExtractPart] = []
    for rank in sorted(by_rank):
        groups: list[list[tuple[int, int, int]]] = [[]]
        room = part_bytes
        for slot in by_rank[rank]:
            start = 0
            while True:
                count = min(slot.numel - start, room // slot.itemsize)
                if count == 0 and slot.numel > start:
                    groups.append([])  # this part is full: start the next one
                    room = part_bytes
                    continue
                groups[-1].append((slot.index, start, count))
                room -= count * slot.itemsize
                start += count
                if start >= slot.numel:
                    break
        for number, pieces in enumerate(g for g in groups if g):
            name = f"rank{rank:05d}-part{number:04d}.safetensors"
            parts.append(
                ExtractPart(index=len(parts), rank=rank, file_name=name, pieces=tuple(pieces))
            )
    return parts


def _kept_tensors(layout: SourceLayout, options: ConvertOptions) -> set[str]:
    return {
        name
        for name, t in layout.tensors.items()
        if not (options.exclude_frozen and t.role == "frozen")
    }


def _check_output_names(layout: SourceLayout, names: list[str]) -> None:
    """Refuse a layout in which two tensors would get one output name, before anything is
    written: a safetensors header keeps each name once, so one of them would be lost
    silently (issue 24). Readers build the names (a DCP selection strips a prefix, pipeline
    and MoE readers rename layer and expert files); this is the check they all share.

    Raises:
        CheckpointFormatError: Naming both sources and the output name.
    """
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise CheckpointFormatError(
                f"{layout.where}: the {layout.format} reader lists '{name}' twice, so two "
                f"tensors would get the output name '{name}' and one would be lost; the "
                "checkpoint's names are not understood. Please report it with `zerosafe "
                "inspect --json` output"
            )
        seen.add(name)
    for alias, target in layout.aliases.items():
        if alias in layout.tensors:
            raise CheckpointFormatError(
                f"{layout.where}: '{alias}' (a tensor) and '{alias}' (an alias of '{target}') "
                f"both have the output name '{alias}', so one would be lost; the checkpoint's "
                "tied names are not understood. Please report it with `zerosafe inspect "
                "--json` output"
            )


def _output_names(
    layout: SourceLayout, kept: set[str], options: ConvertOptions
) -> tuple[list[str], dict[str, str]]:
    """Output tensor names in order, and the aliases recorded instead of written."""
    order = [n for n in layout.order if n in kept or n in layout.aliases]
    listed = set(order)
    order += [n for n in layout.tensors if n in kept and n not in listed]
    names: list[str] = []
    aliases: dict[str, str] = {}
    for name in order:
        target = layout.aliases.get(name)
        if target is None:
            names.append(name)
        elif target not in kept:
            continue  # an excluded target's alias goes too
        elif options.tied == "copy":
            names.append(name)
        else:
            aliases[name] = target
    return names, aliases


def _fragment_rows(
    layout: SourceLayout, specs: list[TensorSpec]
) -> Iterable[tuple[int, int, int, int, int]]:
    """`(tensor, slot, src_offset, numel, dst_offset)` rows; each tensor's must tile it."""
    for spec in specs:
        if spec.role == SCALE_ROLE:
            continue  # computed by the merge from its weight's values: no source fragments
        owner = spec.alias_of or spec.source_name
        covered = 0
        for slot, src_offset, numel, dst in sorted(
            layout.tensors[owner].fragments, key=lambda f: f[3]
        ):
            if dst != covered or src_offset + numel > layout.slots[slot].numel:
                raise LayoutMismatchError(
                    f"{layout.where}: '{owner}' fragments do not tile it (gap or overlap at "
                    f"element {covered}); the checkpoint's layout is not understood"
                )
            covered += numel
            yield (spec.index, slot, src_offset, numel, dst)
        if covered != math.prod(spec.source_shape):
            raise LayoutMismatchError(
                f"{layout.where}: '{owner}' has {math.prod(spec.source_shape)} elements but its "
                f"fragments hold "
                f"{covered}"
            )


def _keep_fp32_warnings(layout: SourceLayout, options: ConvertOptions) -> list[str]:
    """A `keep_fp32` pattern that keeps nothing is most likely a typo: say which."""
    floating = [n for n, t in layout.tensors.items() if dtype_info(t.dtype).is_floating]
    return [
        f"`keep_fp32` (--keep-fp32) pattern '{p}' matches no floating tensor of "
        f"{layout.where}; names look like '{floating[0] if floating else '?'}'"
        for p in options.keep_fp32
        if not any(re.search(p, n) for n in floating)
    ]


def _shard_specs(specs: list[TensorSpec], *, adapter: bool = False) -> list[ShardSpec]:
    count = specs[-1].shard + 1 if specs else 0
    shards = []
    for index in range(count):
        members = [s for s in specs if s.shard == index]
        shards.append(
            ShardSpec(
                index=index,
                file_name=ADAPTER_WEIGHTS_NAME if adapter else shard_file_name(index, count),
                first_tensor=members[0].index, num_tensors=len(members),
                data_bytes=sum(s.out_nbytes for s in members),
            )
        )  # fmt: skip
    return shards


def _option_notes(
    layout: SourceLayout, specs: list[TensorSpec], options: ConvertOptions
) -> list[str]:
    notes = []
    frozen = [n for n, t in layout.tensors.items() if t.role == "frozen"]
    if options.exclude_frozen and frozen:
        notes.append(
            f"{len(frozen)} frozen param(s) left out of the output (`exclude_frozen`, "
            f"--exclude-frozen): {', '.join(frozen[:8])}{' ...' if len(frozen) > 8 else ''}"
        )
    kept = [s.name for s in specs if s.out_dtype == "float32" and options.keeps_fp32(s.name)]
    if kept and options.dtype != "float32":
        notes.append(
            f"{len(kept)} tensor(s) kept in float32 under dtype {options.dtype} (`keep_fp32`, "
            f"--keep-fp32): {', '.join(kept[:8])}{' ...' if len(kept) > 8 else ''}"
        )
    oversized = [s for s in specs if s.out_nbytes > options.max_shard_size]
    if oversized:
        big = max(oversized, key=lambda s: s.out_nbytes)
        notes.append(
            f"{len(oversized)} tensor(s) exceed the shard size of {options.max_shard_size} bytes "
            f"and get a file of their own, the largest '{big.name}' ({big.out_nbytes} bytes); "
            "safetensors files never split a tensor"
        )
    return notes


def _plan_quantization(plan: Plan, layout: SourceLayout, options: ConvertOptions) -> None:
    """Record the release's `quantization_config` (`plan.quantization`, written into the
    copied `config.json`) and say in the notes what was quantized and what was not, and why.

    `modules_to_not_convert` (compressed-tensors: `ignore`) lists the module of every 2-D
    weight left unquantized (tied aliases included), so a loader never expects FP8 where the
    file holds `dtype`; transformers drops its default skips (`lm_head`) once the list is
    given, so it is complete.

    Raises:
        ConfigError: If one band of the widest quantized weight does not fit a task's share
            of `memory` (`zerosafe.quantize.BAND_BYTES_PER_COLUMN`), or (`nvfp4a16`) a
            weight's in-features do not divide into groups of 16.
    """
    assert options.quantize is not None
    quantized = [t for t in plan.tensors if t.quantized]
    for t in quantized:
        if options.quantize == "nvfp4a16" and t.source_shape[1] % FP4_GROUP:
            raise ConfigError(
                f"{layout.where}: `quantize` nvfp4a16 scales '{t.source_name}' "
                f"{list(t.source_shape)} in groups of {FP4_GROUP} along its input dim, expected "
                f"in-features divisible by {FP4_GROUP}, found {t.source_shape[1]} "
                "(compressed-tensors refuses it too); leave it unquantized with "
                f"`quantize_ignore` '{re.escape(t.source_name)}'"
            )
    widest = max(quantized, key=lambda t: t.source_shape[1], default=None)
    if (
        widest is not None
        and widest.source_shape[1] * BAND_BYTES_PER_COLUMN > options.task_memory_bytes
    ):
        need = widest.source_shape[1] * BAND_BYTES_PER_COLUMN
        raise ConfigError(
            f"{layout.where}: `quantize` reads '{widest.source_name}' "
            f"{list(widest.source_shape)} a band of "
            f"128 rows at a time, which holds about {need} bytes, more than the "
            f"{options.task_memory_bytes} bytes one task may hold under `memory` "
            f"{options.memory}; raise `memory` (about {need * options.parallel_tasks} bytes "
            "at this parallelism) or lower `max_parallel_tasks`"
        )
    skipped: dict[str, list[str]] = {}
    modules = []
    for t in plan.tensors:
        if t.role == SCALE_ROLE or t.quantized:
            continue
        owner = layout.tensors[t.alias_of or t.name]
        why = options.quantize_skip_reason(t.name, t.shape, owner.dtype)
        if t.alias_of is not None:
            why = f"an alias of '{t.alias_of}'"
        if len(t.shape) == 2 and t.name.endswith(".weight") and why is not None:
            modules.append(t.name.removesuffix(".weight"))
            skipped.setdefault(why, []).append(t.name)
    modules += [
        a.removesuffix(".weight")
        for a, target in plan.aliases.items()
        if a.endswith(".weight") and len(layout.tensors[target].shape) == 2
    ]
    plan.quantization = quantization_config(options.quantize, modules, options.quantize_scale_fmt)
    params = sum(math.prod(t.source_shape) for t in quantized)
    stored_bits = 8 * sum(t.out_nbytes for t in plan.tensors if t.quantized)
    stored_bits += 8 * sum(t.out_nbytes for t in plan.tensors if t.role == SCALE_ROLE)
    plan.notes.append(
        f"{len(quantized)} weight(s) quantized to {options.quantize} "
        f"({stored_bits / params if params else 0:.3f} bits per parameter with their scales); "
        f"{len(modules)} module(s) left in {options.dtype} (listed in `quantization_config`)"
    )
    for why, names in skipped.items():
        plan.notes.append(
            f"not quantized, {why}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
        )
    if not quantized:
        raise ConfigError(_nothing_to_quantize(layout.where, options.quantize, skipped))


def _nothing_to_quantize(where: str, scheme: str, skipped: dict[str, list[str]]) -> str:
    """The one line refusing a `quantize` that would quantize no weight: a release that says
    it is FP8 and holds none (the first weight and why it was left, what to do)."""
    if not skipped:
        return (
            f"{where}: `quantize` {scheme} found no 2-D weight to quantize (none in the model); "
            "convert without `quantize`"
        )
    # a weight its shape kept out says most: name-based skips (embeddings, norms) are expected
    why, names = min(skipped.items(), key=lambda item: not item[0].startswith("shape"))
    count = sum(len(n) for n in skipped.values())
    return (
        f"{where}: `quantize` {scheme} would quantize none of the model's {count} 2-D "
        f"weight(s), so the release would hold no {scheme} weight: '{names[0]}' is not "
        f"quantized, {why}; use a scheme these shapes take (fp8-dynamic takes any 2-D "
        "weight), narrow `quantize_ignore`, or convert without `quantize`"
    )
