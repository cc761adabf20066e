"""What `zerosafe inspect` reports: the checkpoint, what converting it reads, writes and needs."""

from __future__ import annotations

import math
from typing import Any

from zerosafe.config import PIPELINE_BUFFERS, TASK_OVERHEAD_BYTES, ConvertOptions
from zerosafe.dtypes import OUTPUT_DTYPES, dtype_info
from zerosafe.formats.base import SourceLayout
from zerosafe.plan.model import PACKED_ROLE, Plan
from zerosafe.units import format_bytes

__all__ = ["describe_plan", "render_inspect"]

INTERPRETER_BASELINE_BYTES = 350 * 10**6
"""Resident memory of a worker after importing torch, pyarrow and zerosafe (measured)."""


def describe_plan(
    layout: SourceLayout, plan: Plan, options: ConvertOptions, *, metadata_bytes_read: int
) -> dict[str, Any]:
    """A JSON-able report of the checkpoint (the format's own `facts` first) and the planned
    conversion."""
    params = [t for t in plan.tensors if t.role in ("param", PACKED_ROLE)]

    def named(role: str) -> list[str]:
        return [n for n, t in layout.tensors.items() if t.role == role]

    out_by_dtype = {}
    for dt in OUTPUT_DTYPES:
        total = 0
        for t in plan.tensors:
            dtype = dt if dtype_info(t.src_dtype).is_floating else t.src_dtype
            total += t.numel * dtype_info(dtype).itemsize
        out_by_dtype[dt] = total
    # `fp32_master_bytes` (a key older than the format readers) is the main read: DeepSpeed's
    # fp32 masters, DCP's chunks (`SourceLayout.main_slot_kind`).
    fp32_bytes = sum(s.nbytes for s in plan.slots if s.kind == layout.main_slot_kind)
    other_bytes = plan.slot_bytes - fp32_bytes
    checkpoint_bytes = plan.source.checkpoint_bytes or sum(f.size_bytes for f in plan.files)
    read_bytes = plan.slot_bytes + metadata_bytes_read
    parallel = options.parallel_tasks
    memory = _memory_estimate(plan, options)
    return {
        "format": layout.format,
        **(layout.facts.to_json() if layout.facts is not None else {}),
        "params": {
            "trained": len(named("param")),
            "trained_elements": sum(
                math.prod(t.shape) for t in layout.tensors.values() if t.role == "param"
            ),
            "frozen": named("frozen"),
            "frozen_in_output": not options.exclude_frozen,
            "buffers": named("buffer"),
            "tied": layout.aliases,
            "output_tensors": len(plan.tensors),
            "trained_in_output": len(params),
        },
        "reads": {
            "fp32_master_bytes": fp32_bytes,
            "frozen_and_buffer_bytes": other_bytes,
            "metadata_bytes": metadata_bytes_read,
            "total_bytes": read_bytes,
            "checkpoint_bytes": checkpoint_bytes,
            "fraction_of_checkpoint": read_bytes / checkpoint_bytes if checkpoint_bytes else 0.0,
        },
        "output": {
            "dtype": options.dtype,
            "bytes_by_dtype": out_by_dtype,
            "max_shard_size": options.max_shard_size,
            "shards": [
                {"file": s.file_name, "tensors": s.num_tensors, "bytes": s.data_bytes}
                for s in plan.shards
            ],
            "aliases": plan.aliases,
            "intermediate_bytes": 0 if options.direct else plan.slot_bytes,
        },
        "memory": {
            "budget_bytes": options.memory,
            "parallel_tasks": parallel,
            "chunk_bytes": options.chunk_bytes,
            "task_bytes": options.task_memory_bytes,
            "budget_peak_bytes": parallel * options.task_memory_bytes,
            **memory,
            "interpreter_baseline_bytes": INTERPRETER_BASELINE_BYTES,
        },
        "tasks": {
            "extract": 0 if options.direct else len(plan.parts),
            "merge": len(plan.shards),
            "verify": len(plan.shards),
        },
        "mode": "direct" if options.direct else "staged",
        "mode_reason": options.mode_reason,
        "job_key": plan.job_key,
        "notes": plan.notes,
        "warnings": plan.warnings,
    }


def _memory_estimate(plan: Plan, options: ConvertOptions) -> dict[str, int]:
    """What this checkpoint's tasks hold at most, not only what the budget allows.

    A task's pipeline allocates `PIPELINE_BUFFERS` buffers of one chunk, and a chunk is never
    larger than the largest piece the task copies (`zerosafe.stages.streaming._chunk_need`): a small
    checkpoint needs small buffers whatever the budget. Tasks at once are bounded by the
    budget and by how many tasks a stage has.
    """
    widest = 0  # the largest piece, in the wider of its source and output element
    for t in plan.tensors:
        size = max(dtype_info(t.src_dtype).itemsize, dtype_info(t.out_dtype).itemsize)
        widest = max(widest, t.numel * size)
    if not options.direct:
        for part in plan.parts:
            for slot, _, numel in part.pieces:
                widest = max(widest, numel * plan.slots[slot].itemsize)  # master slot ranges
    buffer_bytes = min(options.chunk_bytes, widest)
    task_bytes = TASK_OVERHEAD_BYTES + PIPELINE_BUFFERS * buffer_bytes
    most_tasks = max(len(plan.shards), 0 if options.direct else len(plan.parts), 1)
    tasks_at_once = min(options.parallel_tasks, most_tasks)
    return {
        "tasks_at_once": tasks_at_once,
        "buffer_bytes": buffer_bytes,
        "peak_bytes": tasks_at_once * task_bytes,
    }


def render_inspect(r: dict[str, Any]) -> str:
    """The `inspect` report for people."""
    p, reads, out, mem = r["params"], r["reads"], r["output"], r["memory"]
    labels = r["read_labels"]
    lines = [
        *r["about"],
        f"  params: {p['trained']} trained ({p['trained_elements']:,} elements), {len(p['frozen'])} frozen"
        + (" (excluded)" if p["frozen"] and not p["frozen_in_output"] else "")
        + f", {len(p['buffers'])} buffers, {len(p['tied'])} tied",
    ]
    for alias, target in p["tied"].items():
        lines.append(f"    tied: {alias} -> {target}")
    if p["frozen"]:
        lines.append(
            f"    frozen: {', '.join(p['frozen'][:8])}{' ...' if len(p['frozen']) > 8 else ''}"
        )
    lines += [
        f"Reads       {format_bytes(reads['total_bytes'])} of the {format_bytes(reads['checkpoint_bytes'])} checkpoint "
        f"({reads['fraction_of_checkpoint'] * 100:.1f}%): {labels['main']} {format_bytes(reads['fp32_master_bytes'])}, "
        f"{labels['other']} {format_bytes(reads['frozen_and_buffer_bytes'])}, {labels['metadata']} "
        f"{format_bytes(reads['metadata_bytes'])}; {labels['never']}",
        "Output      "
        + ", ".join(f"{dt}: {format_bytes(n)}" for dt, n in out["bytes_by_dtype"].items())
        + f"; planned as {out['dtype']} in {len(out['shards'])} file(s) of at most {format_bytes(out['max_shard_size'])}"
        + (
            f" ({over} holding one larger tensor each)"
            if (over := sum(s["bytes"] > out["max_shard_size"] for s in out["shards"]))
            else ""
        ),
    ]
    for shard in out["shards"][:12]:
        lines.append(
            f"  {shard['file']}  {shard['tensors']} tensors  {format_bytes(shard['bytes'])}"
        )
    if len(out["shards"]) > 12:
        lines.append(f"  ... and {len(out['shards']) - 12} more")
    if out["intermediate_bytes"]:
        lines.append(
            f"  work area: {format_bytes(out['intermediate_bytes'])} of intermediates (staged mode; --mode direct skips them)"
        )
    lines.append(
        f"Memory      about {format_bytes(mem['peak_bytes'])} for this checkpoint: {mem['tasks_at_once']} task(s) at once, "
        f"each {PIPELINE_BUFFERS} buffers of {format_bytes(mem['buffer_bytes'])} (its largest piece) plus "
        f"{format_bytes(TASK_OVERHEAD_BYTES)}; plus about {format_bytes(mem['interpreter_baseline_bytes'])} for the interpreter. "
        f"The {format_bytes(mem['budget_bytes'])} budget bounds any checkpoint at {format_bytes(mem['budget_peak_bytes'])} "
        f"({mem['parallel_tasks']} task(s) x {format_bytes(mem['task_bytes'])}, {format_bytes(mem['chunk_bytes'])} chunks)"
    )
    lines.append(
        f"Tasks       {r['tasks']['extract']} extract, {r['tasks']['merge']} merge, {r['tasks']['verify']} verify"
    )
    lines.append(f"Mode        {r['mode_reason'] or r['mode']}")
    for note in r["notes"]:
        lines.append(f"note: {note}")
    for warning in r["warnings"]:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)
