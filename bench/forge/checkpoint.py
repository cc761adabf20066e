"""`forge_checkpoint`: a whole DeepSpeed ZeRO checkpoint, and `ForgeInfo`, what it wrote."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .pipeline import Pipeline
from .spec import Spec
from .torch_file import write_torch_file
from .values import expected_fp32
from .zero2 import zero2_files, zero2_layout
from .zero3 import zero3_files
from .zipwriter import ZIP64_LIMIT


@dataclass
class ForgeInfo:
    """What `forge_checkpoint` wrote."""

    dest: str
    tag: str
    stage: int
    world_size: int
    dtype: str
    seed: int
    params: dict[str, tuple[int, ...]]
    """Every param (trainable and frozen) in module order, aliases excluded."""
    frozen: list[str]
    buffers: dict[str, tuple[tuple[int, ...], str]]
    aliases: dict[str, str]
    param_groups: list[list[str]]
    flat_groups: list[list[str]]
    """ZeRO-2: the optimizer groups; ZeRO-3: the flat sub-groups (what param_shapes lists)."""
    files: list[dict[str, Any]] = field(default_factory=list)
    fp32_bytes: int = 0
    """Bytes of fp32 master weights (all ranks, padding included)."""
    lowp_bytes: int = 0
    moment_bytes: int = 0
    apparent_bytes: int = 0
    written_bytes: int = 0
    seconds: float = 0.0
    peak_buffers: int = 0

    @property
    def gbps(self) -> float:
        """Bytes written (holes excluded) per second, in GB/s."""
        return self.written_bytes / max(self.seconds, 1e-9) / 1e9

    def summary(self) -> str:
        n = sum(math.prod(s) for s in self.params.values())
        lines = [
            f"forged ZeRO-{self.stage} {self.dtype} ws={self.world_size} tag={self.tag}: {n:,} params "
            f"({len(self.params)} tensors, {len(self.frozen)} frozen, aliases {self.aliases or 'none'})"
        ]
        for f in self.files:
            lines.append(
                f"  {os.path.basename(f['path']):60s} {f['apparent_bytes'] / 1e9:9.3f} GB"
                f"  (written {f['written_bytes'] / 1e9:.3f} GB)"
            )
        lines.append(
            f"fp32 masters {self.fp32_bytes / 1e9:.3f} GB, 16-bit {self.lowp_bytes / 1e9:.3f} GB, "
            f"moments {self.moment_bytes / 1e9:.3f} GB; apparent {self.apparent_bytes / 1e9:.3f} GB, "
            f"written {self.written_bytes / 1e9:.3f} GB in {self.seconds:.2f} s = {self.gbps:.2f} GB/s "
            f"({self.apparent_bytes / max(self.seconds, 1e-9) / 1e9:.2f} GB/s apparent)"
        )
        return "\n".join(lines)


def forge_checkpoint(
    dest: str | os.PathLike[str],
    *,
    shapes: Sequence[tuple[str, Sequence[int]]],
    stage: int,
    world_size: int,
    dtype: str = "bf16",
    tag: str = "global_step1",
    sub_group_numel: int | None = None,
    tied: bool | Mapping[str, str] = True,
    frozen: Sequence[str] = (),
    groups: int = 2,
    buffers: Sequence[tuple[str, Sequence[int], str]] | None = None,
    seed: int = 0,
    moments: str = "sparse",
    chunk_bytes: int = 8 << 20,
    threads: int | None = None,
    zip64_threshold: int = ZIP64_LIMIT,
    ds_config: dict[str, Any] | None = None,
    global_steps: int | None = None,
    skipped_steps: int = 0,
    micro_batch: int = 1,
    lr: float = 3e-4,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: tuple[float, float] = (0.1, 0.0),
    write_latest: bool = True,
) -> ForgeInfo:
    """Write a DeepSpeed 0.19.8 ZeRO checkpoint of `shapes` into `dest` (`dest/latest`, `dest/<tag>/`).

    Args:
        shapes: (name, shape) of every param in module order (see `transformer_shapes`).
        stage: 1, 2 or 3 (1 and 2 differ only in `zero_stage`).
        world_size: data-parallel ranks (any, odd included).
        dtype: training precision: "bf16", "fp16" or "fp32" (the module / frozen copies' dtype,
            the `bf16_` file prefix, the loss scaler).
        sub_group_numel: ZeRO-3 `sub_group_size`: an optimizer group's params are cut into flat
            sub-groups, each closed once it holds at least this many elements per rank
            (None: DeepSpeed's default, 1e9).
        tied: True records `lm_head.weight` as an alias of `embed.weight` (`shared_params`);
            a dict gives {alias: target}; False: none.
        frozen: names of params with requires_grad=False (saved in the training dtype only).
        groups: 2 optimizer groups (matrices with weight decay, vectors without) or 1.
        buffers: (name, shape, "float32" | "int64") module buffers; default: one of each.
        seed: changes every value (see `expected_fp32`).
        moments: "sparse" (Adam moments as holes: zeros that take no disk) or "zeros" (written).
        chunk_bytes: bytes per write; memory stays near (threads + 2) * chunk_bytes.
        threads: workers filling chunks (default: up to 8, by CPU count).
        zip64_threshold: sizes/offsets at or above it get ZIP64 fields (lower it to test ZIP64).
        ds_config, global_steps, skipped_steps, micro_batch, lr, betas, eps, weight_decay:
            bookkeeping copied into the files.
    """
    if moments not in ("sparse", "zeros"):
        raise ValueError("moments must be 'sparse' or 'zeros'")
    spec = Spec(
        shapes,
        stage,
        world_size,
        dtype,
        tag,
        sub_group_numel,
        tied,
        frozen,
        groups,
        buffers,
        seed,
        ds_config,
        global_steps,
        skipped_steps,
        micro_batch,
        lr,
        betas,
        eps,
        weight_decay,
    )
    dest = os.fspath(dest)
    tag_dir = os.path.join(dest, tag)
    os.makedirs(tag_dir, exist_ok=True)
    threads = threads if threads is not None else max(1, min(8, os.cpu_count() or 1))
    info = _new_info(spec, dest)
    started = time.perf_counter()
    pipe = Pipeline(chunk_bytes, threads, seed)
    try:
        file_objs = zero3_files(spec, moments) if stage == 3 else zero2_files(spec, moments)
        _write_files(info, tag_dir, file_objs, pipe, zip64_threshold)
    finally:
        pipe.close()
    info.peak_buffers = pipe.allocated
    fp32, lowp = _layout_bytes(spec)
    info.fp32_bytes, info.lowp_bytes, info.moment_bytes = fp32, lowp, 2 * fp32
    if write_latest:
        with open(os.path.join(dest, "latest"), "w") as fh:
            fh.write(tag)
    info.seconds = time.perf_counter() - started
    return info


def _new_info(spec: Spec, dest: str) -> ForgeInfo:
    """What the files will hold, before any is written."""
    flat_groups = spec.sub_groups if spec.stage == 3 else spec.groups
    return ForgeInfo(
        dest=dest,
        tag=spec.tag,
        stage=spec.stage,
        world_size=spec.ws,
        dtype=spec.dtype,
        seed=spec.seed,
        params={p.name: p.shape for p in spec.params},
        frozen=[p.name for p in spec.frozen],
        buffers={n: (s, dt) for n, s, dt in spec.buffers},
        aliases=dict(spec.aliases),
        param_groups=[[p.name for p in g] for g in spec.groups],
        flat_groups=[[p.name for p in g] for g in flat_groups],
    )


def _write_files(
    info: ForgeInfo,
    tag_dir: str,
    file_objs: list[tuple[str, dict[str, Any]]],
    pipe: Pipeline,
    zip64_threshold: int,
) -> None:
    """Write each (file name, contents) into `tag_dir`, in order, adding it to `info`."""
    for fname, obj in file_objs:
        rec = write_torch_file(
            os.path.join(tag_dir, fname),
            obj,
            pipeline=pipe,
            seed=info.seed,
            zip64_threshold=zip64_threshold,
        )
        rec.pop("storages")
        info.files.append(rec)
        info.apparent_bytes += rec["apparent_bytes"]
        info.written_bytes += rec["written_bytes"]


def _layout_bytes(spec: Spec) -> tuple[int, int]:
    """Bytes of fp32 masters and of 16-bit (training dtype) copies, all ranks, from the layout
    (independent of how the moments were written)."""
    ws = spec.ws
    if spec.stage == 3:
        per_rank = sum(-(-p.numel // ws) for sg in spec.sub_groups for p in sg)
        lowp = sum(-(-p.numel // ws) for p in spec.frozen) * ws * spec.lowp_itemsize
        return per_rank * ws * 4, lowp
    padded = sum(g.padded for g in zero2_layout(spec))
    return padded * 4, (padded + sum(p.numel for p in spec.frozen)) * spec.lowp_itemsize


def expected_state(info: ForgeInfo, name: str) -> np.ndarray:
    """The full fp32 value of a param (or alias) of a forged checkpoint, shaped."""
    target = info.aliases.get(name, name)
    shape = info.params[target]
    return expected_fp32(target, 0, math.prod(shape), info.seed).reshape(shape)
