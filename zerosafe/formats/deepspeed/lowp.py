"""The 16-bit copies DeepSpeed ZeRO-1/2 keeps beside its fp32 masters, as the `LowpWitness`
that `check_lowp` and `verify --against` compare the output with (the readers' optional
`ReadsLowpCopies` capability): the module states' `module` (pipeline parallel: the layer
files; MoE experts: the expert files). See docs/formats.md.
"""

from __future__ import annotations

from zerosafe.formats.base import LowpCopy, LowpWitness
from zerosafe.formats.deepspeed.save_identity import lowp_copy_missing, module_copies
from zerosafe.formats.deepspeed.types import PipelineCheckpoint, ZeroCheckpoint

__all__ = ["LOWP_DTYPES", "zero_lowp_witness"]

LOWP_DTYPES = ("bfloat16", "float16")
"""The dtypes of a module copy worth comparing (an fp32 copy is the masters' own data)."""


def zero_lowp_witness(ckpt: ZeroCheckpoint | PipelineCheckpoint) -> LowpWitness:
    """Every 16-bit copy of a trained or frozen param of `ckpt`, params first, in the
    checkpoint's order; or why it keeps none (ZeRO-3, trained in fp32)."""
    missing = lowp_copy_missing(ckpt)
    if missing is not None:
        return LowpWitness(missing=missing)
    copies = module_copies(ckpt)
    out = []
    for name in [*ckpt.param_names, *(fp.name for fp in ckpt.frozen)]:
        for model, tensor, offset in copies.get(name, ()):
            if tensor.dtype not in LOWP_DTYPES or tensor.numel == 0:
                continue
            out.append(
                LowpCopy(
                    name=name, file_url=model.url, source=model.zip.source,
                    byte_offset=model.zip.tensor_offset(tensor), numel=tensor.numel,
                    dtype=tensor.dtype, element_offset=offset, partial=model.role == "expert",
                )
            )  # fmt: skip
    return LowpWitness(copies=tuple(out))
