"""Element types: the one dtype vocabulary of zerosafe.

The engine passes dtypes around as torch's names (`"bfloat16"`), so the plan and the manifests
stay plain data; `torch_dtype` turns a name into a torch dtype only where bytes are cast. Each
`DType` also carries the other names a dtype has: the training-precision spelling users type
(`bf16`: `--dtype`, job files, DeepSpeed configs), the code in a safetensors header (`BF16`)
and the typed-storage class a `torch.save` pickle names (`BFloat16Storage`).
safetensors dtype codes: https://github.com/huggingface/safetensors#format
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerosafe.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIASES",
    "DTYPES",
    "OUTPUT_DTYPES",
    "DType",
    "dtype_info",
    "from_safetensors_code",
    "output_dtype",
    "short_name",
    "torch_dtype",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class DType:
    name: str
    """torch's name, without `torch.`: `float32`, `bfloat16`, `int64`."""
    itemsize: int
    safetensors_code: str | None
    """The code in a safetensors header (`F32`), or None where safetensors has none."""
    is_floating: bool
    short: str | None = None
    """The training-precision spelling (`fp32`, `bf16`, `fp16`), for the three output dtypes."""
    storage_class: str | None = None
    """The typed-storage class a `torch.save` pickle names for it (`FloatStorage`), if any."""


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType(name="float64", itemsize=8, safetensors_code="F64", is_floating=True,
              storage_class="DoubleStorage"),
        DType(name="float32", itemsize=4, safetensors_code="F32", is_floating=True,
              short="fp32", storage_class="FloatStorage"),
        DType(name="float16", itemsize=2, safetensors_code="F16", is_floating=True,
              short="fp16", storage_class="HalfStorage"),
        DType(name="bfloat16", itemsize=2, safetensors_code="BF16", is_floating=True,
              short="bf16", storage_class="BFloat16Storage"),
        DType(name="float8_e4m3fn", itemsize=1, safetensors_code="F8_E4M3", is_floating=True),
        DType(name="float8_e5m2", itemsize=1, safetensors_code="F8_E5M2", is_floating=True),
        DType(name="float8_e8m0fnu", itemsize=1, safetensors_code="F8_E8M0", is_floating=True),
        DType(name="int64", itemsize=8, safetensors_code="I64", is_floating=False,
              storage_class="LongStorage"),
        DType(name="int32", itemsize=4, safetensors_code="I32", is_floating=False,
              storage_class="IntStorage"),
        DType(name="int16", itemsize=2, safetensors_code="I16", is_floating=False,
              storage_class="ShortStorage"),
        DType(name="int8", itemsize=1, safetensors_code="I8", is_floating=False,
              storage_class="CharStorage"),
        DType(name="uint8", itemsize=1, safetensors_code="U8", is_floating=False,
              storage_class="ByteStorage"),
        DType(name="uint16", itemsize=2, safetensors_code="U16", is_floating=False),
        DType(name="uint32", itemsize=4, safetensors_code="U32", is_floating=False),
        DType(name="uint64", itemsize=8, safetensors_code="U64", is_floating=False),
        DType(name="bool", itemsize=1, safetensors_code="BOOL", is_floating=False,
              storage_class="BoolStorage"),
        DType(name="complex64", itemsize=8, safetensors_code="C64", is_floating=False,
              storage_class="ComplexFloatStorage"),
        DType(name="complex128", itemsize=16, safetensors_code=None, is_floating=False,
              storage_class="ComplexDoubleStorage"),
    )
}  # fmt: skip

_BY_CODE = {d.safetensors_code: d for d in DTYPES.values() if d.safetensors_code}

ALIASES = {d.short: d.name for d in DTYPES.values() if d.short} | {"half": "float16"}
"""Training-precision spellings users and configs use -> torch names."""

OUTPUT_DTYPES = ("float32", "bfloat16", "float16")
"""What a conversion may write floating tensors as (`--dtype fp32|bf16|fp16`)."""


def dtype_info(name: str) -> DType:
    """Look up a dtype by torch name or alias (`fp32`, `bf16`, `fp16`)."""
    key = ALIASES.get(name, name)
    try:
        return DTYPES[key]
    except KeyError:
        raise ValueError(f"unknown dtype '{name}'; known: {', '.join(sorted(DTYPES))}") from None


def output_dtype(name: str) -> str:
    """`fp32`/`bf16`/`fp16` or a torch name -> the torch name of an output dtype.

    Raises:
        ConfigError: For a dtype a conversion does not write.
    """
    key = ALIASES.get(name, name)
    if key not in OUTPUT_DTYPES:
        raise ConfigError(f"`dtype` must be one of fp32, bf16, fp16 (got '{name}')")
    return key


def short_name(name: str) -> str:
    """The training-precision spelling of a dtype (`bfloat16` -> `bf16`), or its torch name
    where it has none."""
    return dtype_info(name).short or dtype_info(name).name


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
