"""Forge a PyTorch DCP checkpoint of any size quickly, in one process: FSDP2's layout.

    python -m bench.forge_dcp OUT_DIR --params 500M [--world-size 8] [--dtype fp32]

Every param (Llama-like shapes from `bench.forge.transformer_shapes`) is cut on dim 0 into
`world_size` chunks as FSDP2's `Shard(0)` cuts it (`ceil(rows / world_size)` rows each, the
last ones shorter or empty); rank `r`'s chunks, then its AdamW moments (`exp_avg`,
`exp_avg_sq`, fp32, the same cut), each `torch.save`d one after another into `__r_0.distcp`;
a `step` non-tensor entry in rank 0's file; and `.metadata`, built from torch's own
metadata classes and pickled as `torch.distributed.checkpoint.save` pickles it. Keys are
`model.NAME` and `optim.state.NAME.exp_avg`, the layout of `get_state_dict(model, optim)`.
Values are seeded random normals, so `dcp_to_torch_save` (the oracle) can load it.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.forge import parse_count, transformer_shapes

__all__ = ["DcpForgeInfo", "forge_dcp_checkpoint", "main"]


@dataclass(frozen=True)
class DcpForgeInfo:
    path: str
    num_params: int
    model_bytes: int
    """Bytes of the model's chunks (what a conversion copies)."""
    total_bytes: int
    """Every file, optimizer state included."""


def _row_cuts(rows: int, world_size: int) -> list[tuple[int, int]]:
    """`(start, count)` of each rank's dim-0 chunk, as `Shard(0)` cuts a tensor."""
    per = math.ceil(rows / world_size) if rows else 0
    return [
        (min(r * per, rows), max(0, min(rows, (r + 1) * per) - min(r * per, rows)))
        for r in range(world_size)
    ]


def _saved(tensor: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def forge_dcp_checkpoint(
    dest: str | Path,
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    *,
    world_size: int = 4,
    dtype: str = "float32",
    optimizer: bool = True,
    seed: int = 0,
) -> DcpForgeInfo:
    """Write a DCP checkpoint of `shapes` into the folder `dest` (see the module docstring)."""
    import torch
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    rng = np.random.default_rng(seed)
    entries: list[tuple[str, tuple[int, ...], Any]] = []
    for name, shape in shapes:
        entries.append((f"model.{name}", shape, torch_dtype))
    if optimizer:
        for name, shape in shapes:
            for moment in ("exp_avg", "exp_avg_sq"):
                entries.append((f"optim.state.{name}.{moment}", shape, torch.float32))
    sd_meta: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    files = [open(dest / f"__{r}_0.distcp", "wb") for r in range(world_size)]  # noqa: SIM115
    try:
        for fqn, shape, dt in entries:
            full = torch.from_numpy(rng.standard_normal(math.prod(shape), dtype=np.float32))
            full = full.to(dt).reshape(shape)
            chunks = []
            for rank, (start, count) in enumerate(_row_cuts(shape[0], world_size)):
                offsets = (start, *([0] * (len(shape) - 1)))
                sizes = (count, *shape[1:])
                chunks.append(
                    m.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                )
                data = _saved(full[start : start + count].clone())
                f = files[rank]
                storage[m.MetadataIndex(fqn, torch.Size(offsets), 0)] = _StorageInfo(
                    f"__{rank}_0.distcp", f.tell(), len(data)
                )
                f.write(data)
            sd_meta[fqn] = m.TensorStorageMetadata(
                properties=m.TensorProperties(dtype=dt), size=torch.Size(shape), chunks=chunks
            )
        step = _saved(torch.tensor(1000).item())
        storage[m.MetadataIndex("step")] = _StorageInfo("__0_0.distcp", files[0].tell(), len(step))
        files[0].write(step)
        sd_meta["step"] = m.BytesStorageMetadata()
    finally:
        for f in files:
            f.close()
    meta = m.Metadata(state_dict_metadata=sd_meta, storage_data=storage, version="1.0.0")
    with open(dest / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    num_params = sum(math.prod(s) for _, s in shapes)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    return DcpForgeInfo(
        path=str(dest),
        num_params=num_params,
        model_bytes=num_params * itemsize,
        total_bytes=sum(p.stat().st_size for p in dest.iterdir()),
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--params", default="500M")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--no-optimizer", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    info = forge_dcp_checkpoint(
        args.out, transformer_shapes(parse_count(args.params)), world_size=args.world_size,
        dtype=args.dtype, optimizer=not args.no_optimizer,
    )  # fmt: skip
    print(info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
