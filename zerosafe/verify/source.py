"""`verify --against`: is this output a conversion of *this* checkpoint?

Shapes alone cannot tell: the same model trained twice has the same names and shapes. Two
independent witnesses can:

- the source's content fingerprint (`SourceLayout.source.content_sha256`, DeepSpeed:
  `zerosafe.formats.deepspeed.facts.content_fingerprint`), recorded in the manifest at
  conversion time: a SHA-256 over every zip record's name, size and CRC-32 of every file the
  conversion read. It comes from the zip directories alone (no tensor byte is read), does
  not change when a checkpoint is copied or moved, and changes with any change of any stored
  tensor;
- a sample of values: for every trained parameter, the first elements of each of its
  fragments (one per rank in ZeRO-3) are read from the checkpoint's fp32 master weights, cast
  to the output dtype exactly as the conversion casts, and compared bit for bit with the
  output. (DCP: the first elements of every chunk, from the chunk's stored bytes.) A
  quantized weight (`--quantize`) is dequantized with its scales instead and each value
  compared within the format's rounding bound (`zerosafe.verify.quantized`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerosafe.cast import cast_bytes
from zerosafe.dtypes import dtype_info
from zerosafe.io.storage import ByteSource, Storage, join_url
from zerosafe.quantize import FP8_BLOCK, FP8_DTYPE, SCALE_SUFFIXES
from zerosafe.verify.tensors import Failure, parse_safetensors_header

if TYPE_CHECKING:
    from zerosafe.formats.base import SourceLayout

__all__ = ["SAMPLE_ELEMENTS", "sample_values"]

SAMPLE_ELEMENTS = 64
"""Elements read per fragment by the value sample."""


def sample_values(
    storage: Storage,
    out_url: str,
    layout: SourceLayout,
    stored: dict[str, tuple[str, dict[str, Any]]],
    failures: list[Failure],
) -> int:
    """Compare a sample of every trained parameter with the checkpoint's master weights.

    Args:
        stored: tensor name -> (file, {"dtype", "shape"}) of the output.
        failures: Receives one `values` failure per tensor whose sample differs.

    Returns:
        How many fragments were compared.
    """
    from zerosafe.config import ConvertOptions
    from zerosafe.plan.build import plan_layout
    from zerosafe.stages.shards import DirectLocator

    # Trained params only (the sample never reads frozen ones, which a layout read with
    # `exclude_frozen` lists without fragments).
    plan = plan_layout(layout, ConvertOptions(dtype="float32", tied="copy", exclude_frozen=True))
    locator = DirectLocator(plan, storage)
    outputs: dict[str, tuple[ByteSource, dict[str, Any], int]] = {}
    compared = 0
    try:
        for tensor in plan.tensors:
            key = tensor.name if tensor.name in stored else tensor.name + "_packed"
            if tensor.role != "param" or key not in stored:
                continue
            file, info = stored[key]
            if file not in outputs:
                src = storage.open_source(join_url(out_url, file))
                entries, _, data_start = parse_safetensors_header(src)
                outputs[file] = (src, entries, data_start)
            out_src, entries, data_start = outputs[file]
            out_dtype = str(info["dtype"])
            entry = entries.get(key)
            if entry is None or dtype_info(out_dtype).itemsize == 0:
                continue
            out_item = dtype_info(out_dtype).itemsize
            packed = key != tensor.name  # NVFP4: two values a byte
            begin = data_start + int(entry["data_offsets"][0])
            sampled: set[int] = set()
            for slot, src_offset, numel, dst_offset in plan.fragments.for_tensor(tensor.index):
                count = min(numel, SAMPLE_ELEMENTS)
                if count == 0 or slot in sampled:
                    continue  # one run per slot: a DCP chunk split on dim 1 is a run per row
                sampled.add(slot)
                src_dtype = plan.slots[slot].dtype
                raw = b"".join(
                    seg.source.read_range(seg.offset, seg.offset + seg.nbytes)
                    for seg in locator.locate(slot, src_offset, count)
                )
                start = begin + dst_offset * out_item
                got = b"" if packed else out_src.read_range(start, start + count * out_item)
                compared += 1
                if packed:
                    same = _within_fp4_bound(
                        out_src, data_start, entries, tensor.name, begin, raw, src_dtype,
                        dst_offset, tensor.shape,
                    )  # fmt: skip
                elif out_dtype == FP8_DTYPE:
                    same = _within_bound(
                        out_src, data_start, entries, tensor.name, got, raw, src_dtype,
                        dst_offset, tensor.shape,
                    )  # fmt: skip
                else:
                    same = got == cast_bytes(raw, src_dtype, out_dtype)
                if not same:
                    failures.append(
                        Failure(
                            file,
                            tensor.name,
                            "values",
                            f"elements {dst_offset}..{dst_offset + count - 1} differ from the "
                            f"checkpoint's master weights in {plan.files[plan.slots[slot].file].url.rsplit('/', 1)[-1]}",
                        )
                    )
                    break
    finally:
        locator.close()
        for src, *_ in outputs.values():
            src.close()
    return compared


def _within_bound(
    out_src: ByteSource,
    data_start: int,
    entries: dict[str, Any],
    name: str,
    got: bytes,
    raw: bytes,
    src_dtype: str,
    dst_offset: int,
    shape: tuple[int, ...],
) -> bool:
    """Whether the FP8 bytes `got` of weight `name`, from element `dst_offset` on, dequantize
    to within e4m3's rounding bound of the master values `raw` (`src_dtype`); False when
    the weight's scales are missing."""
    import numpy as np

    from zerosafe.verify.quantized import decode_scales, find_scale, within_rounding_bound

    suffix = find_scale(name, entries)
    scale = entries.get(name + suffix)
    if scale is None or len(shape) != 2:
        return False
    begin, end = scale["data_offsets"]
    grid = [int(n) for n in scale["shape"]]
    raw_scales = out_src.read_range(data_start + begin, data_start + end)
    scales = decode_scales(raw_scales, scale["dtype"]).reshape(grid)
    master = np.frombuffer(cast_bytes(raw, src_dtype, "float32"), dtype="<f4")
    elements = np.arange(dst_offset, dst_offset + len(got))
    rows, cols = elements // shape[1], elements % shape[1]
    if suffix == SCALE_SUFFIXES["fp8-block"]:
        per_element = scales[rows // FP8_BLOCK, cols // FP8_BLOCK]
    else:
        per_element = scales[rows, 0]
    return within_rounding_bound(got, per_element, master)


def _within_fp4_bound(
    out_src: ByteSource,
    data_start: int,
    entries: dict[str, Any],
    name: str,
    begin: int,
    raw: bytes,
    src_dtype: str,
    dst_offset: int,
    shape: tuple[int, ...],
) -> bool:
    """Whether NVFP4 weight `name`'s packed codes (stored from file offset `begin`), from
    element `dst_offset` on, dequantize to within E2M1's rounding bound of the master values
    `raw` (`src_dtype`), with its group scales over its global scale; False when they are
    missing."""
    import ml_dtypes
    import numpy as np

    from zerosafe.verify.quantized import fp4_values, within_fp4_bound

    scale, whole = entries.get(name + "_scale"), entries.get(name + "_global_scale")
    if scale is None or whole is None or len(shape) != 2:
        return False
    master = np.frombuffer(cast_bytes(raw, src_dtype, "float32"), dtype="<f4")
    first, last = dst_offset // 2, (dst_offset + len(master) + 1) // 2
    values = fp4_values(out_src.read_range(begin + first, begin + last))
    values = values[dst_offset % 2 : dst_offset % 2 + len(master)]
    at, end = (data_start + o for o in scale["data_offsets"])
    grid = np.frombuffer(out_src.read_range(at, end), dtype=ml_dtypes.float8_e4m3fn)
    grid = grid.astype(np.float32).reshape([int(n) for n in scale["shape"]])
    at, end = (data_start + o for o in whole["data_offsets"])
    global_scale = np.frombuffer(out_src.read_range(at, end), dtype="<f4")[0]
    elements = np.arange(dst_offset, dst_offset + len(master))
    per_element = grid[elements // shape[1], elements % shape[1] // 16] / global_scale
    return within_fp4_bound(values, per_element, master)
