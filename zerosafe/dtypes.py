"""Element types, named as torch names them, with their safetensors codes.

The engine passes dtypes around as these names (`"bfloat16"`), so the plan and the manifests
stay plain data; `torch_dtype` turns a name into a torch dtype only where bytes are cast.
safetensors dtype codes: https://github.com/huggingface/safetensors#format
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "DType", "dtype_info", "from_safetensors_code", "torch_dtype"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DType:
    name: str
    """torch's name, without `torch.`: `float32`, `bfloat16`, `int64`."""
    itemsize: int
    safetensors_code: str | None
    """The code in a safetensors header (`F32`), or None where safetensors has none."""
    is_floating: bool


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType(name="float64", itemsize=8, safetensors_code="F64", is_floating=True),
        DType(name="float32", itemsize=4, safetensors_code="F32", is_floating=True),
        DType(name="float16", itemsize=2, safetensors_code="F16", is_floating=True),
        DType(name="bfloat16", itemsize=2, safetensors_code="BF16", is_floating=True),
        DType(name="float8_e4m3fn", itemsize=1, safetensors_code="F8_E4M3", is_floating=True),
        DType(name="float8_e5m2", itemsize=1, safetensors_code="F8_E5M2", is_floating=True),
        DType(name="int64", itemsize=8, safetensors_code="I64", is_floating=False),
        DType(name="int32", itemsize=4, safetensors_code="I32", is_floating=False),
        DType(name="int16", itemsize=2, safetensors_code="I16", is_floating=False),
        DType(name="int8", itemsize=1, safetensors_code="I8", is_floating=False),
        DType(name="uint8", itemsize=1, safetensors_code="U8", is_floating=False),
        DType(name="uint16", itemsize=2, safetensors_code="U16", is_floating=False),
        DType(name="uint32", itemsize=4, safetensors_code="U32", is_floating=False),
        DType(name="uint64", itemsize=8, safetensors_code="U64", is_floating=False),
        DType(name="bool", itemsize=1, safetensors_code="BOOL", is_floating=False),
        DType(name="complex64", itemsize=8, safetensors_code="C64", is_floating=False),
        DType(name="complex128", itemsize=16, safetensors_code=None, is_floating=False),
    )
}

_BY_CODE = {d.safetensors_code: d for d in DTYPES.values() if d.safetensors_code}

# Training-precision spellings users and configs use.
ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}


def dtype_info(name: str) -> DType:
    """Look up a dtype by torch name or alias (`fp32`, `bf16`, `fp16`)."""
    key = ALIASES.get(name, name)
    try:
        return DTYPES[key]
    except KeyError:
        raise ValueError(f"unknown dtype '{name}'; known: {', '.join(sorted(DTYPES))}") from None


def from_safetensors_code(code: str) -> DType:
    """The dtype of a safetensors header code (`BF16`)."""
    try:
        return _BY_CODE[code]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype '{code}'") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a name."""
    import torch

    result = getattr(torch, dtype_info(name).name)
    assert isinstance(result, torch.dtype)
    return result
