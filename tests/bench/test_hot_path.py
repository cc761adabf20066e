"""The hot path's fast variants give exactly what the plain torch calls give.

The cast runs in slices below torch's parallel grain (`streaming._CAST_STEP`), and verify
counts NaN/Inf only after an integer test of the exponent bits; both must be bit-for-bit what
one whole-tensor torch call returns, wherever the special values sit (a NaN's bits aside: the
cast keeps it a NaN of its sign, `zerosafe.cast`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import assert_torch_cast
from zerosafe.formats.safetensors import HeaderEntry, SafetensorsStreamWriter
from zerosafe.io.storage import Storage
from zerosafe.stages import streaming
from zerosafe.stages.streaming import CopyJob, copy_stream
from zerosafe.verify import tensors as verify


def _values(n: int, seed: int = 0) -> torch.Tensor:
    """Random fp32 bit patterns (NaNs of every payload, Infs, subnormals) plus normal values."""
    g = torch.Generator().manual_seed(seed)
    raw = (
        torch.randint(-(2**31), 2**31 - 1, (n // 2,), generator=g, dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )
    normal = torch.randn(n - n // 2, generator=g) * 1e3
    x = torch.cat([raw, normal])
    specials = torch.tensor(
        [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 65520.0, 3.4e38, 1e-45]
    )
    # specials right at slice boundaries, and a tie-to-even pattern
    for i, pos in enumerate([0, streaming._CAST_STEP - 1, streaming._CAST_STEP, n - 1]):
        x[pos] = specials[i % len(specials)]
    x[streaming._CAST_STEP + 1] = (torch.tensor([0x3F808000], dtype=torch.int32)).view(
        torch.float32
    )[0]
    return x


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_cast_in_slices_equals_one_torch_call(tmp_path: Path, out_dtype: torch.dtype) -> None:
    n = 3 * streaming._CAST_STEP + 777  # several slices and a ragged tail in one chunk
    src = _values(n)
    (tmp_path / "src.bin").write_bytes(src.numpy().tobytes())
    name = str(out_dtype).removeprefix("torch.")
    storage = Storage()
    writer = SafetensorsStreamWriter(
        storage.open_sink(str(tmp_path / "o.safetensors")), [HeaderEntry("t", name, (n,))]
    )
    source = storage.open_source(str(tmp_path / "src.bin"))
    copy_stream([CopyJob(0, source, 0, n * 4, "float32", name)], writer, chunk_bytes=n * 4)
    writer.finish()
    got = load_file(str(tmp_path / "o.safetensors"))["t"]
    assert_torch_cast(got, src, out_dtype)


_BITS = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_nonfinite_counts_equal_torch(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    n = 3 * (verify._MASK_BLOCK_BYTES // dtype.itemsize) + 5  # several mask blocks
    g = torch.Generator().manual_seed(1)
    finite = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    view = memoryview(bytearray(finite.view(_BITS[dtype]).numpy().tobytes()))
    assert verify._count_nonfinite(view, name) == (0, 0, 0)
    for positions in ([n - 1], [0, n // 2], [verify._MASK_BLOCK_BYTES // dtype.itemsize]):
        t = finite.clone()
        for i, pos in enumerate(positions):
            t[pos] = [float("nan"), float("inf"), float("-inf")][i % 3]
        t[-2] = float("-inf")
        raw = bytearray(t.view(_BITS[dtype]).numpy().tobytes())
        want = (int(t.isnan().sum()), int(t.isposinf().sum()), int(t.isneginf().sum()))
        assert verify._count_nonfinite(memoryview(raw), name) == want


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float64"])
def test_nonfinite_scan_agrees_with_numpy_on_every_kind_of_value(name: str) -> None:
    """`_nonfinite_in` reads the bits as signed and as unsigned integers: every 16-bit
    pattern, and for the wider floats the edges (signed zeros, largest finite, smallest
    subnormals, infinities, quiet and signalling NaNs of either sign)."""
    import ml_dtypes
    import numpy as np

    kind, exponent = verify._EXPONENT_BITS[name]
    if name in ("bfloat16", "float16"):
        bits = np.arange(2**16, dtype=np.uint16)
        values = bits.view(ml_dtypes.bfloat16 if name == "bfloat16" else np.float16)
        finite = np.isfinite(values.astype(np.float32))
    else:
        width = 32 if name == "float32" else 64
        unsigned = np.dtype(kind).type
        fraction = (1 << (width - 1)) - exponent - 1  # all fraction bits
        sign = 1 << (width - 1)
        plain = [0, 1, fraction, exponent - 1, exponent, exponent + 1, exponent | 1 << 2,
                 exponent | fraction, exponent >> 1]  # fmt: skip
        bits = np.array([v | s for v in plain for s in (0, sign)], dtype=unsigned)
        finite = np.isfinite(bits.view(np.float32 if width == 32 else np.float64))
    got = np.array([verify._nonfinite_in(bits[i : i + 1], exponent) for i in range(len(bits))])
    assert np.array_equal(got, ~finite)
    assert not verify._nonfinite_in(bits[:0], exponent)


def test_hash_and_count_equals_hashing_whole_then_counting() -> None:
    """Block by block (`_hash_and_count`), the digests and counts are the whole chunk's."""
    import hashlib

    n = 3 * (verify._MASK_BLOCK_BYTES // 2) + 7
    t = (torch.rand(n, generator=torch.Generator().manual_seed(3)) - 0.5).to(torch.bfloat16)
    for poison in ([], [n // 2], [n - 1, 5]):
        u = t.clone()
        for i, pos in enumerate(poison):
            u[pos] = [float("-inf"), float("nan")][i % 2]
        view = memoryview(bytearray(u.view(torch.int16).numpy().tobytes()))
        digests = [verify.new_digest(verify.TENSOR_CHECKSUM), hashlib.sha256()]
        counts = verify._hash_and_count(view, "bfloat16", digests)
        whole = verify.new_digest(verify.TENSOR_CHECKSUM)
        whole.update(view)
        assert digests[0].hexdigest() == whole.hexdigest()
        assert digests[1].hexdigest() == hashlib.sha256(view).hexdigest()
        assert counts == verify._count_nonfinite(view, "bfloat16")
        assert counts == (int(u.isnan().sum()), int(u.isposinf().sum()), int(u.isneginf().sum()))


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_mapped_source_copies_the_same_bytes(tmp_path: Path, out_dtype: str) -> None:
    from zerosafe.io.mapped import MappedFile, map_source

    n = 2 * streaming._CAST_STEP + 99
    src = _values(n, seed=2)
    (tmp_path / "src.bin").write_bytes(b"\0" * 100 + src.numpy().tobytes())
    outs = []
    for mapped in (False, True):
        storage = Storage()
        source = storage.open_source(str(tmp_path / "src.bin"))
        if mapped:
            source = map_source(source, storage.counter)
            assert isinstance(source, MappedFile)
        path = tmp_path / f"o{mapped}.safetensors"
        writer = SafetensorsStreamWriter(
            storage.open_sink(str(path)), [HeaderEntry("t", out_dtype, (n,))]
        )
        # unaligned offsets, chunks that end mid-page
        jobs = [
            CopyJob(0, source, 100, 4 * 1001, "float32", out_dtype),
            CopyJob(0, source, 100 + 4 * 1001, 4 * (n - 1001), "float32", out_dtype),
        ]
        copy_stream(jobs, writer, chunk_bytes=4 * 5000 + 8)
        writer.finish()
        source.close()
        assert storage.counter.bytes_read == 4 * n
        outs.append(path.read_bytes())
    assert outs[0] == outs[1]


def test_mapped_source_refuses_a_short_file(tmp_path: Path) -> None:
    from zerosafe.errors import CheckpointFormatError
    from zerosafe.io.mapped import map_source

    (tmp_path / "src.bin").write_bytes(b"\x01" * 10_000)
    storage = Storage()
    source = map_source(storage.open_source(str(tmp_path / "src.bin")), storage.counter)
    assert bytes(source.view_range(9_000, 1_000)) == b"\x01" * 1_000  # type: ignore[attr-defined]
    with pytest.raises(CheckpointFormatError, match="truncated"):
        source.view_range(9_000, 1_001)  # type: ignore[attr-defined]
    out = tmp_path / "o.safetensors"
    writer = SafetensorsStreamWriter(
        storage.open_sink(str(out)), [HeaderEntry("t", "uint8", (20_000,))]
    )
    with pytest.raises(CheckpointFormatError, match="truncated"):
        copy_stream([CopyJob(0, source, 0, 20_000, "uint8", "uint8")], writer, chunk_bytes=4096)
    writer.abort()
    source.close()
    assert not out.exists()


def test_accelerated_crc32_is_zips_crc32() -> None:
    import os
    import zlib

    data = os.urandom(3 * 2**20 + 7)
    for start in (0, 1, 4093):
        assert streaming._crc32(data[start:]) == zlib.crc32(data[start:])
        assert streaming._crc32(data[start:], 0xDEADBEEF) == zlib.crc32(data[start:], 0xDEADBEEF)
    assert streaming._crc32(memoryview(bytearray(data))[5:]) == zlib.crc32(data[5:])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_cast_shared_between_threads_equals_one_torch_call(out_dtype: torch.dtype) -> None:
    """A chunk large enough to be cut between the caller and a helper thread casts to the
    same bits, boundaries between the threads' runs included."""
    from concurrent.futures import ThreadPoolExecutor

    n = 2 * streaming._PARALLEL_CAST_MIN + 12345
    src = _values(n, seed=3)
    name = str(out_dtype).removeprefix("torch.")
    out = bytearray(n * 2)
    with ThreadPoolExecutor(1) as helpers:
        view = streaming._cast(memoryview(src.numpy()).cast("B"), "float32", out, name, helpers)
    got = torch.frombuffer(bytearray(view), dtype=out_dtype)
    assert_torch_cast(got, src, out_dtype)
