"""A conversion `Plan` from a DCP layout: dtype policy, shard assignment and extract parts.

TODO(format-reader interface): this repeats the format-agnostic tail of
`zerosafe.plan.model.build_plan`; when the generic planner takes a `SourceLayout`, the DCP
reader hands it one and this module goes away.
"""

from __future__ import annotations

import numpy as np

from zerosafe.config import ConvertOptions
from zerosafe.dtypes import dtype_info
from zerosafe.errors import LayoutMismatchError
from zerosafe.formats.dcp.reader import DcpLayout
from zerosafe.plan.model import (
    FragmentTable,
    Plan,
    ShardSpec,
    TensorSpec,
    _plan_parts,
    job_key_of,
    shard_file_name,
)

__all__ = ["build_dcp_plan"]


def build_dcp_plan(layout: DcpLayout, options: ConvertOptions) -> Plan:
    """Plan the conversion of a DCP layout under `options` (no file is read).

    Raises:
        LayoutMismatchError: If a tensor's fragments do not tile it (a reader bug).
    """
    specs: list[TensorSpec] = []
    shard, shard_bytes = 0, 0
    blocks = []
    for t in layout.tensors:
        out_dtype = options.dtype if dtype_info(t.dtype).is_floating else t.dtype
        nbytes = t.numel * dtype_info(out_dtype).itemsize
        if shard_bytes and shard_bytes + nbytes > options.max_shard_bytes:
            shard, shard_bytes = shard + 1, 0
        shard_bytes += nbytes
        spec = TensorSpec(
            index=len(specs), name=t.name, shape=t.shape, role=t.role,
            src_dtype=t.dtype, out_dtype=out_dtype, shard=shard,
        )  # fmt: skip
        frags = t.fragments()
        if int(frags[:, 2].sum()) != t.numel:
            raise LayoutMismatchError(f"{layout.url}: '{t.fqn}' fragments do not tile it")
        block = np.empty((len(frags), 5), dtype=np.int64)
        block[:, 0] = spec.index
        block[:, 1:] = frags
        blocks.append(block)
        specs.append(spec)
    num_shards = shard + 1 if specs else 0
    shards = []
    for index in range(num_shards):
        members = [s for s in specs if s.shard == index]
        shards.append(
            ShardSpec(
                index=index, file_name=shard_file_name(index, num_shards),
                first_tensor=members[0].index, num_tensors=len(members),
                data_bytes=sum(s.out_nbytes for s in members),
            )
        )  # fmt: skip
    rows = np.concatenate(blocks) if blocks else np.zeros((0, 5), dtype=np.int64)
    fragments = FragmentTable.from_rows(rows.tolist())
    slots = list(layout.slots)
    used = sorted(set(fragments.slot.tolist()))
    return Plan(
        plan_id=job_key_of("dcp", list(layout.identity), options),
        source={**layout.source, "tag": None},
        options=options.identity(),
        files=list(layout.files),
        slots=slots,
        tensors=specs,
        shards=shards,
        parts=_plan_parts(slots, used, options.extract_part_bytes),
        fragments=fragments,
        aliases=dict(layout.aliases),
        notes=list(layout.notes),
        warnings=list(layout.warnings),
    )
