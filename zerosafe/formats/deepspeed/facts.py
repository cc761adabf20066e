"""What a ZeRO checkpoint is, for the plan's source block and `inspect`: its files, stage,
dtypes and optimizer, and a fingerprint of its contents."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from zerosafe.dtypes import short_name
from zerosafe.formats.base import InspectFacts, ReadLabels, SourceDescription
from zerosafe.formats.deepspeed.moe import describe_moe
from zerosafe.formats.deepspeed.slots import swap_files
from zerosafe.formats.deepspeed.types import ZeroCheckpoint
from zerosafe.io.storage import FileIdentity
from zerosafe.units import format_bytes

__all__ = ["ZeroSource", "content_fingerprint", "source_block", "zero_facts"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroSource:
    """A ZeRO checkpoint's own fields of the manifest's `source` block (`SourceDetails`)."""

    ORDER: ClassVar[tuple[str, ...]] = (
        "checkpoint", "tag", "tag_url", "stage", "optimizer", "world_size", "train_dtype",
        "master_dtype", "optimizer_name", "ds_version", "num_params", "checkpoint_bytes",
        "files", "content_sha256", "moe", "pipeline_stages",
    )  # fmt: skip

    stage: int
    optimizer: str
    """`zero` or `bf16_optimizer` (DeepSpeed's BF16_Optimizer)."""
    world_size: int
    train_dtype: str
    master_dtype: str
    optimizer_name: str
    ds_version: str | None
    moe: dict[str, Any] | None = None
    """The MoE layers (`describe_moe`), where the model has any."""
    pipeline_stages: int | None = None
    """Pipeline parallel: the number of stages."""

    @property
    def order(self) -> tuple[str, ...]:
        return self.ORDER

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {
            "stage": self.stage,
            "optimizer": self.optimizer,
            "world_size": self.world_size,
            "train_dtype": self.train_dtype,
            "master_dtype": self.master_dtype,
            "optimizer_name": self.optimizer_name,
            "ds_version": self.ds_version,
        }
        if self.moe is not None:
            out["moe"] = self.moe
        if self.pipeline_stages is not None:
            out["pipeline_stages"] = self.pipeline_stages
        return out

    def headline(self, common: SourceDescription) -> str:
        return f"(tag {common.tag}, ZeRO-{self.stage}, world size {self.world_size})"


def source_block(ckpt: ZeroCheckpoint, *, pipeline_stages: int | None = None) -> SourceDescription:
    """The manifest's `source` block of a ZeRO checkpoint (pipeline parallel: with its
    number of stages)."""
    identities = _identities(ckpt)
    return SourceDescription(
        format="deepspeed",
        checkpoint=ckpt.ckpt_url,
        tag=ckpt.tag,
        tag_url=ckpt.tag_url,
        num_params=sum(math.prod(s) for _, s in ckpt.trained_params),
        checkpoint_bytes=sum(i.size_bytes for i in identities),
        files=tuple(identities),
        content_sha256=content_fingerprint(ckpt),
        details=ZeroSource(
            stage=ckpt.stage,
            optimizer=ckpt.optimizer_kind,
            world_size=ckpt.world_size,
            train_dtype=ckpt.train_dtype,
            master_dtype=ckpt.master_dtype,
            optimizer_name=ckpt.optimizer_name,
            ds_version=ckpt.ds_version,
            moe=describe_moe(ckpt.moe)[1] if ckpt.moe is not None else None,
            pipeline_stages=pipeline_stages,
        ),
    )


def zero_facts(ckpt: ZeroCheckpoint) -> InspectFacts:
    """`inspect`'s DeepSpeed section (its keys predate the format readers: kept as they are)."""
    total = sum(i.size_bytes for i in _identities(ckpt))
    about = [
        f"Checkpoint  {ckpt.ckpt_url}  (DeepSpeed ZeRO, tag {ckpt.tag})",
        f"  ZeRO stage {ckpt.stage}"
        + (" (BF16_Optimizer)" if ckpt.optimizer_kind == "bf16_optimizer" else "")
        + f", trained in {ckpt.train_dtype}, data-parallel world size {ckpt.world_size}, "
        f"DeepSpeed {ckpt.ds_version or 'unknown'}",
        f"  master weights in {ckpt.master_dtype}"
        + (" (low-precision masters)" if ckpt.master_dtype != "float32" else "")
        + f", optimizer {ckpt.optimizer_name}",
        f"  files: {len(ckpt.optim_files)} optimizer + {len(ckpt.model_files)} model states"
        + (f" + {len(ckpt.expert_files)} MoE expert" if ckpt.expert_files else "")
        + (f" + {len(ckpt.swapped)} NVMe swap files" if ckpt.swapped else "")
        + f", {format_bytes(total)} in all",
    ]
    moe = describe_moe(ckpt.moe) if ckpt.moe is not None else None
    if moe is not None:
        about.append(moe[0])
    fields: dict[str, object] = {
        "checkpoint": ckpt.ckpt_url,
        "tag": ckpt.tag,
        "zero_stage": ckpt.stage,
        "optimizer": ckpt.optimizer_kind,
        "train_dtype": ckpt.train_dtype,
        "master_dtype": ckpt.master_dtype,
        "optimizer_name": ckpt.optimizer_name,
        "zero_element_params": [n for n, _, _ in ckpt.empty_params],
        "nvme_swap_files": len(ckpt.swapped),
        "world_size": ckpt.world_size,
        "deepspeed_version": ckpt.ds_version,
        "moe": moe[1] if moe is not None else None,
        "files": {
            "optimizer": len(ckpt.optim_files),
            "model_states": len(ckpt.model_files),
            "experts": len(ckpt.expert_files),
            "total_bytes": total,
        },
    }
    labels = ReadLabels(
        main=f"{short_name(ckpt.master_dtype)} masters",
        other="frozen params and buffers",
        metadata="pickles and zip directories",
        never=_never_read(ckpt.optimizer_name),
    )
    return InspectFacts(fields=fields, about=about, read_labels=labels)


def _identities(ckpt: ZeroCheckpoint) -> list[FileIdentity]:
    """Every file a conversion reads: optimizer and model states, then NVMe swap files."""
    return [f.identity for f in ckpt.files] + [w.identity for w in swap_files(ckpt)]


def _never_read(optimizer_name: str) -> str:
    """What `inspect` says is left unread: `AdamW (state exp_avg, exp_avg_sq)` -> Adam moments."""
    state = optimizer_name.partition("(")[2].rstrip(")").removeprefix("state ")
    if state in ("exp_avg, exp_avg_sq", "no state saved", ""):
        return "Adam moments are never read"
    return f"optimizer state ({state}) is never read"


def content_fingerprint(ckpt: ZeroCheckpoint) -> str:
    """SHA-256 over (file name, record name, size, CRC-32) of every record of every file: it
    comes from the zip directories alone, survives copies and moves, and changes with any
    stored tensor (`verify --against` compares it)."""
    h = hashlib.sha256()
    for f in ckpt.files:
        h.update(f.url.rsplit("/", 1)[-1].encode() + b"\0")
        for name, record in sorted(f.zip.records.items()):
            short = name.split("/", 1)[-1]  # the archive folder is the save's file stem
            h.update(f"{short}\0{record.size_bytes}\0{record.crc32}\n".encode())
    for swap in swap_files(ckpt):  # raw files without a CRC: their names and sizes
        name = "/".join(swap.url.rsplit("/", 2)[-2:])
        h.update(f"{name}\0{swap.identity.size_bytes}\n".encode())
    return h.hexdigest()
