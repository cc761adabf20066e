"""One data-parallel group of ZeRO files read into a `ZeroCheckpoint`: the whole checkpoint, or
one pipeline stage's `mp_rank_XX` files (pickles only, no weights).

The keys each file holds are described in docs/formats.md ("DeepSpeed ZeRO"); this module
checks them, refuses what it does not support by name, and returns a `ZeroCheckpoint` the
planner turns into a plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from zerosafe.errors import (
    CheckpointFormatError,
    LayoutMismatchError,
    UnsupportedCheckpointError,
)
from zerosafe.formats.deepspeed.files import MODEL_RE, OPTIM_RE, Z3_MODEL_RE, check_ranks
from zerosafe.formats.deepspeed.layout import FlatGroup, GroupParam
from zerosafe.formats.deepspeed.masters import (
    MASTER_DTYPES,
    SWAP_FOLDER,
    find_swap_files,
    master_dtype_of,
    optimizer_name_of,
)
from zerosafe.formats.deepspeed.module_side import read_module_side
from zerosafe.formats.deepspeed.moe import read_moe_layout
from zerosafe.formats.deepspeed.moe_common import MoELayout
from zerosafe.formats.deepspeed.save_identity import check_one_save
from zerosafe.formats.deepspeed.types import LoadedFile, ZeroCheckpoint
from zerosafe.formats.torch_zip import InertObject, TensorRecord
from zerosafe.io.storage import Storage

__all__ = [
    "TESTED_DEEPSPEED_VERSIONS",
    "master_notes",
    "open_rank_files",
    "read_param_groups",
    "refuse_moe_in_model_parallel_files",
    "train_dtype_of",
]


TESTED_DEEPSPEED_VERSIONS = ("0.19.",)
"""Version prefixes of DeepSpeed whose checkpoints the test-suite converts."""


def open_rank_files(
    ckpt_url: str,
    tag: str,
    tag_url: str,
    storage: Storage,
    optim_by_rank: dict[int, LoadedFile],
    model_by_rank: dict[int, LoadedFile],
    *,
    expert_files: Mapping[tuple[int, int], LoadedFile] | None = None,
    pipeline_stage: int | None = None,
    model_parallel: int = 1,
) -> ZeroCheckpoint:
    """The `ZeroCheckpoint` of one data-parallel group's loaded files (the whole checkpoint, or
    one pipeline stage's `mp_rank_XX` files, whose model states record `model_parallel` as
    `mp_world_size`), with its MoE expert files by `(layer, expert)` (plain data parallelism
    only: `scan_files` refuses experts beside model-parallel files)."""
    mp = pipeline_stage or 0
    expert_files = dict(expert_files or {})
    first_optim = optim_by_rank[min(optim_by_rank)]
    osd0 = first_optim.obj.get("optimizer_state_dict")
    if not isinstance(osd0, Mapping):
        raise CheckpointFormatError(
            f"{first_optim.url}: no 'optimizer_state_dict'; not a DeepSpeed optimizer file"
        )
    stage, optimizer_kind = _stage_of(osd0, first_optim.url)
    model0 = _model0(tag_url, stage, model_by_rank, mp)
    world_size = _world_size_of(first_optim, model0.obj.get("dp_world_size"))
    _check_world_sizes(model0, first_optim, world_size, model_parallel)
    check_ranks(tag_url, "optimizer", optim_by_rank, world_size, stage, mp, storage)
    if stage == 3:
        check_ranks(tag_url, "model states", model_by_rank, world_size, stage, mp, storage)
    optim_files = [optim_by_rank[r] for r in range(world_size)]
    model_files = [model_by_rank[r] for r in sorted(model_by_rank)]
    check_one_save(tag_url, optim_files, model_files)
    _check_optim_files_agree(optim_files, first_optim, stage, optimizer_kind, world_size)
    param_groups = read_param_groups(model_files, stage)
    moe = read_moe_layout(
        tag_url=tag_url, stage=stage, world_size=world_size, optim_files=optim_files,
        model_files=model_files, param_groups=param_groups, expert_files=expert_files,
    )  # fmt: skip
    if moe is not None:
        refuse_moe_in_model_parallel_files(
            [*optim_files, *model_files], pipeline_stage, model_parallel
        )
    ds_version = model0.obj.get("ds_version") or osd0.get("ds_version")
    ckpt = ZeroCheckpoint(
        ckpt_url=ckpt_url, tag=tag, tag_url=tag_url, stage=stage,
        optimizer_kind=optimizer_kind, world_size=world_size,
        train_dtype=train_dtype_of(model0.obj, [n for g in param_groups for n, _ in g]),
        ds_version=str(ds_version) if ds_version is not None else None,
        optim_files=optim_files, model_files=model_files, param_groups=param_groups,
        fp32_partitions=[], frozen=[], buffers=[], shared={}, module_order=[], moe=moe,
        expert_files=[expert_files[k] for k in sorted(expert_files)],
        pipeline_stage=pipeline_stage,
    )  # fmt: skip
    if moe is not None:
        ckpt.notes += moe.notes
    ckpt.optimizer_name = optimizer_name_of(ckpt)
    _version_and_optimizer_notes(ckpt)
    _read_partitions(ckpt, storage)
    read_module_side(ckpt)
    master_notes(ckpt)
    return ckpt


def refuse_moe_in_model_parallel_files(
    files: list[LoadedFile], pipeline_stage: int | None, model_parallel: int
) -> None:
    """An MoE layout read from a pipeline stage or model-parallel rank files (AutoEP ZeRO-3
    writes no expert files, so `scan_files` cannot tell from the listing): refused."""
    names = [f.url.rsplit("/", 1)[-1] for f in files]
    mp_named = [
        n
        for n in names
        if (m := OPTIM_RE.match(n) or Z3_MODEL_RE.match(n) or MODEL_RE.match(n))
        and int(m.groups()[-1]) != 0
    ]
    if pipeline_stage is None and model_parallel == 1 and not mp_named:
        return
    shown = mp_named[0] if mp_named else names[0]
    raise UnsupportedCheckpointError(
        f"{files[0].url.rsplit('/', 1)[0]}: an MoE checkpoint (expert param groups or AutoEP "
        f"metadata) whose files are model-parallel ({shown}"
        + (f", pipeline stage {pipeline_stage}" if pipeline_stage is not None else "")
        + "): MoE combined with pipeline or tensor parallelism is not supported; zerosafe "
        "converts MoE checkpoints with data and expert parallelism only (mp_rank_00 files)."
    )


def _stage_of(osd: Mapping[str, Any], url: str) -> tuple[int, str]:
    raw = osd.get("zero_stage")
    if raw is None:
        if "single_partition_of_fp32_groups" in osd:
            return 1, "bf16_optimizer"
        raise CheckpointFormatError(
            f"{url}: not a ZeRO checkpoint: 'optimizer_state_dict' has no 'zero_stage' and no "
            f"fp32 partitions (keys: {sorted(osd)})"
        )
    stage = raw.value if isinstance(raw, InertObject) else raw
    if stage not in (1, 2, 3):
        raise UnsupportedCheckpointError(
            f"{url}: ZeRO stage {stage!r} is not supported (stages 1, 2 and 3 are). Stage 0 "
            "checkpoints hold no partitioned fp32 weights; load them with DeepSpeed instead."
        )
    return int(stage), "zero"


def _world_size_of(f: LoadedFile, dp_world_size: Any) -> int:
    """The data-parallel world size an optimizer file was partitioned over: its
    `partition_count` (ZeRO-1/2: per param group). MoE expert groups are partitioned over fewer
    ranks (their expert-data-parallel group), so only the dense groups' count is the world
    size; with expert groups alone it is the model states' `dp_world_size`."""
    osd = f.obj["optimizer_state_dict"]
    partition_count = osd.get("partition_count")
    if isinstance(partition_count, int):
        return partition_count
    if not isinstance(partition_count, (list, tuple)) or not partition_count:
        raise CheckpointFormatError(f"{f.url}: unreadable 'partition_count' {partition_count!r}")
    counts = [int(c) for c in partition_count]
    if len(set(counts)) == 1:
        return counts[0]
    base = osd.get("base_optimizer_state")
    groups = base.get("param_groups") if isinstance(base, Mapping) else None
    moe = [bool(g.get("moe")) for g in groups] if isinstance(groups, (list, tuple)) else []
    if len(moe) != len(counts) or not any(moe):
        raise UnsupportedCheckpointError(
            f"{f.url}: param groups are partitioned over different world sizes ({counts}) and "
            "none is an MoE expert group (`moe: True` in the optimizer's param groups); this "
            "layout is not supported"
        )
    dense = {c for c, m in zip(counts, moe, strict=True) if not m}
    if len(dense) > 1:
        raise LayoutMismatchError(
            f"{f.url}: the dense param groups are partitioned over different world sizes "
            f"({sorted(dense)}); the file is not understood"
        )
    if dense:
        return dense.pop()
    if isinstance(dp_world_size, int):
        return dp_world_size
    return max(counts)


def train_dtype_of(model: Mapping[str, Any], param_names: list[str]) -> str:
    module = model.get("module")
    if isinstance(module, Mapping):
        for name in param_names:
            t = module.get(name)
            if isinstance(t, TensorRecord):
                return t.dtype
    cfg = model.get("ds_config") or {}
    if isinstance(cfg, Mapping):
        for key, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
            section = cfg.get(key)
            if isinstance(section, Mapping) and section.get("enabled"):
                return dtype
    return "float32"


def _shapes(groups: Any, url: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    if not isinstance(groups, (list, tuple)) or not groups:
        raise CheckpointFormatError(f"{url}: 'param_shapes' is missing or empty")
    out = []
    for group in groups:
        if not isinstance(group, Mapping):
            raise CheckpointFormatError(f"{url}: 'param_shapes' entries must be dicts")
        out.append([(str(k), tuple(int(s) for s in v)) for k, v in group.items()])
    return out


def master_notes(ckpt: ZeroCheckpoint) -> None:
    if ckpt.master_dtype != "float32":
        key = "bf16" if ckpt.master_dtype == "bfloat16" else "fp16"
        ckpt.notes.append(
            f"master weights are {ckpt.master_dtype} (`{key}_master_weights_and_grads`): the "
            "groups DeepSpeed names fp32 hold them, and the output is their exact cast (fp32 "
            f"output adds no precision; DeepSpeed's zero_to_fp32 returns them as {ckpt.master_dtype})"
        )
    if ckpt.empty_params:
        ckpt.notes.append(
            f"{len(ckpt.empty_params)} zero-element param(s) are in the output with their shape "
            "and no data: " + ", ".join(f"{n} {list(s)}" for n, s, _ in ckpt.empty_params)
        )


def _model0(
    tag_url: str, stage: int, model_by_rank: dict[int, LoadedFile], mp: int = 0
) -> LoadedFile:
    """Rank 0's model states, which hold the shapes; refused when it belongs to another run."""
    if (
        stage == 3
        and len(model_by_rank) == 1
        and 0 in model_by_rank
        and model_by_rank[0].url.endswith(f"/mp_rank_{mp:02d}_model_states.pt")
    ):
        raise CheckpointFormatError(
            f"{tag_url}: ZeRO-3 optimizer files but a ZeRO-1/2 'mp_rank_{mp:02d}_model_states.pt'; "
            "files from different runs are mixed"
        )
    model0 = model_by_rank.get(0)
    if model0 is None:
        raise CheckpointFormatError(
            f"{tag_url}: rank 0's model states file is missing "
            f"({f'zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt' if stage == 3 else f'mp_rank_{mp:02d}_model_states.pt'}); "
            "copy the whole tag folder."
        )
    return model0


def _check_world_sizes(
    model0: LoadedFile, first_optim: LoadedFile, world_size: int, model_parallel: int = 1
) -> None:
    dp_world_size = model0.obj.get("dp_world_size")
    mp_world_size = model0.obj.get("mp_world_size")
    if isinstance(mp_world_size, int) and mp_world_size > model_parallel:
        raise UnsupportedCheckpointError(
            f"{model0.url}: mp_world_size={mp_world_size}; tensor-parallel checkpoints are not "
            "supported yet: the checkpoint does not record how each parameter is split across "
            "the model-parallel ranks"
        )
    if isinstance(dp_world_size, int) and dp_world_size != world_size:
        raise LayoutMismatchError(
            f"{model0.url}: dp_world_size={dp_world_size} but {first_optim.url} was partitioned "
            f"over {world_size} ranks; files from runs with different world sizes are mixed. "
            "Use one run's complete tag folder."
        )


def _check_optim_files_agree(
    optim_files: list[LoadedFile],
    first_optim: LoadedFile,
    stage: int,
    optimizer_kind: str,
    world_size: int,
) -> None:
    """Every optimizer file has the first one's ZeRO stage, optimizer and world size."""
    for f in optim_files:
        osd = f.obj.get("optimizer_state_dict")
        if not isinstance(osd, Mapping):
            raise CheckpointFormatError(f"{f.url}: no 'optimizer_state_dict'")
        f_stage, f_kind = _stage_of(osd, f.url)
        if (f_stage, f_kind) != (stage, optimizer_kind):
            raise LayoutMismatchError(
                f"{f.url}: ZeRO stage {f_stage} ({f_kind}) but {first_optim.url} says stage "
                f"{stage} ({optimizer_kind}); files from different runs are mixed"
            )
        f_ws = _world_size_of(f, world_size)
        if f_ws != world_size:
            raise LayoutMismatchError(
                f"{f.url}: partitioned over {f_ws} ranks, but {first_optim.url} over "
                f"{world_size}; files from runs with different world sizes are mixed. Use one "
                "run's complete tag folder."
            )


def read_param_groups(
    model_files: list[LoadedFile], stage: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """`param_shapes` of rank 0 (ZeRO-3: the same in every rank's file), names unique."""
    model0 = model_files[0]
    param_groups = _shapes(model0.obj.get("param_shapes"), model0.url)
    if stage == 3:
        for f in model_files[1:]:
            if _shapes(f.obj.get("param_shapes"), f.url) != param_groups:
                raise LayoutMismatchError(
                    f"{f.url}: 'param_shapes' differ from {model0.url}; the rank files come "
                    "from different runs"
                )
    names_seen: set[str] = set()
    for group in param_groups:
        for name, _ in group:
            if name in names_seen:
                raise CheckpointFormatError(
                    f"{model0.url}: param '{name}' appears twice in 'param_shapes'"
                )
            names_seen.add(name)
    return param_groups


def _version_and_optimizer_notes(ckpt: ZeroCheckpoint) -> None:
    if ckpt.ds_version is None or not ckpt.ds_version.startswith(TESTED_DEEPSPEED_VERSIONS):
        ckpt.warnings.append(
            f"checkpoint written by DeepSpeed {ckpt.ds_version or 'of unknown version'}; zerosafe "
            f"is tested with DeepSpeed {', '.join(v + 'x' for v in TESTED_DEEPSPEED_VERSIONS)}. "
            "Run `zerosafe verify --against` on the output."
        )
    if ckpt.optimizer_kind == "bf16_optimizer":
        ckpt.notes.append(
            "optimizer is DeepSpeed's BF16_Optimizer (bf16 + ZeRO-1 + fp32 grad accumulation), "
            "which DeepSpeed's zero_to_fp32 refuses; its fp32 partitions are converted the ZeRO-1 way"
        )


def _read_partitions(ckpt: ZeroCheckpoint, storage: Storage) -> None:
    key = "fp32_flat_groups" if ckpt.stage == 3 else "single_partition_of_fp32_groups"
    for f in ckpt.optim_files:
        osd = f.obj["optimizer_state_dict"]
        groups = osd.get(key)
        if not isinstance(groups, (list, tuple)) or not groups:
            raise CheckpointFormatError(f"{f.url}: '{key}' is missing or empty")
        for t in groups:
            if not isinstance(t, TensorRecord) or t.dtype not in MASTER_DTYPES or len(t.shape) != 1:
                raise CheckpointFormatError(
                    f"{f.url}: '{key}' must hold 1-D master weights in "
                    f"{'/'.join(MASTER_DTYPES)}, found {t!r}"
                )
            if not t.is_contiguous():
                raise CheckpointFormatError(f"{f.url}: a '{key}' tensor is not contiguous")
        ckpt.fp32_partitions.append(list(groups))
    counts = {len(p) for p in ckpt.fp32_partitions}
    if len(counts) != 1:
        raise LayoutMismatchError(
            f"{ckpt.tag_url}: ranks hold different numbers of fp32 groups ({sorted(counts)}); "
            "files from different runs are mixed"
        )
    ckpt.master_dtype = master_dtype_of(ckpt, key)
    if ckpt.stage == 3 and ckpt.moe is not None:
        _zero3_moe_partitions(ckpt, ckpt.moe)
    elif ckpt.stage == 3:
        _zero3_partitions(ckpt, storage)
    else:
        _zero12_partitions(ckpt)


def _zero3_moe_partitions(ckpt: ZeroCheckpoint, moe: MoELayout) -> None:
    """AutoEP ZeRO-3: each sub-group partitioned over its own ranks, `ceil(numel / count)`
    elements of each param per rank; a partition saved empty (NVMe) is refused, as DeepSpeed
    refuses to save AutoEP ZeRO-3 with NVMe offload."""
    for group in moe.groups:
        count = len(group.parts)
        want = sum(-(-p.numel // count) for p in group.params)
        for r, h in group.parts:
            got = ckpt.fp32_partitions[r][h].numel
            if got != want:
                raise LayoutMismatchError(
                    f"{ckpt.optim_files[r].url}: fp32 sub-group {h} holds {got} elements but "
                    f"{group.label}, partitioned over {count} rank(s), needs exactly {want}; "
                    "was the checkpoint saved with another world size or another model?"
                )
    ckpt.flat_groups = list(moe.groups)


def _zero3_partitions(ckpt: ZeroCheckpoint, storage: Storage) -> None:
    """Every sub-group partition holds `sum(ceil(numel / world_size))` elements of its params,
    saved in the optim file or (NVMe offload) saved empty there and kept in a swap file."""
    if len(ckpt.fp32_partitions[0]) != len(ckpt.param_groups):
        if all(t.numel for groups in ckpt.fp32_partitions for t in groups):
            return  # the reader checks the total; sub-groups are only needed to place swaps
        raise LayoutMismatchError(
            f"{ckpt.model_files[0].url}: 'param_shapes' has {len(ckpt.param_groups)} sub-groups "
            f"but {ckpt.optim_files[0].url} has {len(ckpt.fp32_partitions[0])} fp32 partitions; "
            "was the checkpoint saved with another world size or another model?"
        )
    want = [
        sum(-(-math.prod(shape) // ckpt.world_size) for _, shape in group)
        for group in ckpt.param_groups
    ]
    missing: dict[tuple[int, int], int] = {}
    for f in ckpt.optim_files:
        for g, t in enumerate(ckpt.fp32_partitions[f.rank]):
            if t.numel == 0 and want[g] > 0:
                missing[(f.rank, g)] = want[g]
            elif t.numel != want[g]:
                raise LayoutMismatchError(
                    f"{f.url}: fp32 partition {g} of rank {f.rank} holds {t.numel} elements but "
                    f"'param_shapes' partitioned over {ckpt.world_size} ranks needs exactly {want[g]}; "
                    "was the checkpoint saved with another world size or another model?"
                )
    if missing:
        ckpt.swapped = find_swap_files(storage, ckpt, missing)
        ckpt.notes.append(
            f"{len(missing)} master partition(s) offloaded to NVMe are read from their swap "
            f"files in {SWAP_FOLDER}/ (the optimizer files hold them empty)"
        )


def _zero12_partitions(ckpt: ZeroCheckpoint) -> None:
    """Every flat group with its partition size and alignment paddings. Without MoE a group's
    partitions are its index in every rank's file; MoE groups come from `ckpt.moe`."""
    num_groups = len(ckpt.fp32_partitions[0])
    if num_groups != len(ckpt.param_groups):
        raise LayoutMismatchError(
            f"{ckpt.model_files[0].url}: 'param_shapes' has {len(ckpt.param_groups)} groups but "
            f"{ckpt.optim_files[0].url} has {num_groups} fp32 partitions"
        )
    if ckpt.moe is not None:
        groups = ckpt.moe.groups
    else:
        groups = [
            FlatGroup(
                label=f"param group {g}", parts=tuple((r, g) for r in range(ckpt.world_size)),
                params=tuple(GroupParam(name=n, numel=math.prod(s)) for n, s in group),
            )
            for g, group in enumerate(ckpt.param_groups)
        ]  # fmt: skip
    ckpt.flat_groups = [_sized_group(ckpt, group) for group in groups]


def _sized_group(ckpt: ZeroCheckpoint, group: FlatGroup) -> FlatGroup:
    """`group` with its partition size (every partition but the last holds it; the last less
    its `group_paddings`) and the alignment padding after each param."""
    r0, h0 = group.parts[0]
    raw_paddings = ckpt.optim_files[r0].obj["optimizer_state_dict"].get("param_alignment_paddings")
    if raw_paddings is not None:
        pads = tuple(int(p) for p in raw_paddings[h0])
    else:
        pads = (0,) * len(group.params)
    saved = [ckpt.fp32_partitions[r][h].numel for r, h in group.parts]
    gpads = []
    for r, h in group.parts:
        gp = ckpt.optim_files[r].obj["optimizer_state_dict"].get("group_paddings")
        gpads.append(int(gp[h]) if isinstance(gp, (list, tuple)) and len(gp) > h else 0)
    if ckpt.optimizer_kind == "zero":
        sizes = {s + p for s, p in zip(saved, gpads, strict=True)}
    else:  # BF16_Optimizer saves whole partitions, padding included
        sizes = set(saved)
    if len(sizes) != 1:
        raise LayoutMismatchError(
            f"{ckpt.tag_url}: {group.label} partitions disagree (saved {saved}, paddings "
            f"{gpads}); files from different runs are mixed"
        )
    return dataclasses.replace(group, partition_numel=sizes.pop(), alignment_paddings=pads)
