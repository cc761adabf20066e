"""Test helpers: assemble a layout's tensors with plain file reads (no zerosafe I/O code)."""

from __future__ import annotations

import math
from typing import Any

import torch

from zerosafe.dtypes import torch_dtype
from zerosafe.formats.base import SourceLayout, SourceTensor


def assemble(layout: SourceLayout, tensor: SourceTensor) -> torch.Tensor:
    """The tensor, copied fragment by fragment from the source files."""
    dtype = torch_dtype(tensor.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(tensor.shape)
    buf = bytearray(numel * itemsize)
    covered = 0
    for slot_index, src, count, dst in tensor.fragments:
        slot = layout.slots[slot_index]
        assert slot.dtype == tensor.dtype and src + count <= slot.numel
        with open(layout.files[slot.file].url, "rb") as f:
            f.seek(slot.byte_offset + src * itemsize)
            buf[dst * itemsize : (dst + count) * itemsize] = f.read(count * itemsize)
        covered += count
    assert covered == numel
    if not numel:
        return torch.empty(tensor.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(tensor.shape).clone()


def same_bits(a: Any, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaNs included)."""
    if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(
        torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )
