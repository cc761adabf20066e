"""The copy: casts equal torch's `.to()` bit for bit, across chunk boundaries, and every range
read is in the CRC ledger, both as the threaded pipeline and fused block by block."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import assert_torch_cast
from zerosafe.errors import ConfigError
from zerosafe.formats.crc import CrcLedger
from zerosafe.formats.safetensors import HeaderEntry, SafetensorsStreamWriter
from zerosafe.io.storage import Storage
from zerosafe.stages import streaming
from zerosafe.stages.streaming import CopyJob, CopyPolicy, copy_mode, copy_stream


@pytest.fixture(params=["fused", "pipeline"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> CopyPolicy:
    """Each copy test runs both ways (the run's `CopyPolicy`); fused blocks are cut small and
    odd, as the pipeline's chunks are below, so that a tensor and a record span many of
    them."""
    monkeypatch.setattr(streaming, "FUSED_BLOCK_BYTES", 4096 + 12)
    return CopyPolicy(str(request.param))


def _special_fp32(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.logspace(-45, 38, n, base=2.0)
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            65504.0,
            65520.0,
            1e-45,
            3.4e38,
            1.00390625,
            1.01171875,
        ],
        dtype=torch.float32,
    )
    # bit patterns exactly halfway between two bf16 values (ties to even) and random bits
    ties = (torch.arange(64, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    raw = (
        torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )
    return torch.cat([x, specials, ties, raw])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunked_cast_equals_torch_to(
    tmp_path: Path, out_dtype: torch.dtype, mode: CopyPolicy
) -> None:
    src = _special_fp32(50_001)
    src_path = tmp_path / "src.bin"
    src_path.write_bytes(src.numpy().tobytes())
    name = str(out_dtype).removeprefix("torch.")
    out_path = tmp_path / "out.safetensors"
    storage = Storage()
    source = storage.open_source(str(src_path))
    writer = SafetensorsStreamWriter(
        storage.open_sink(str(out_path)), [HeaderEntry("t", name, (src.numel(),))]
    )
    # two jobs with an odd split, and chunks much smaller than the tensor
    half = 4 * 12_345
    jobs = [
        CopyJob(0, source, 0, half, "float32", name),
        CopyJob(0, source, half, src.numel() * 4 - half, "float32", name),
    ]
    copy_stream(jobs, writer, chunk_bytes=4096 + 12, copy=mode)
    writer.finish()
    got = load_file(str(out_path))["t"]
    assert int(torch.isnan(src).sum()) > 1
    if out_dtype == torch.float32:
        assert torch.equal(got.view(torch.uint8), src.view(torch.uint8))
    else:
        assert_torch_cast(got, src, out_dtype)


def _uint8_file(tmp_path: Path, data: bytes) -> tuple[Any, SafetensorsStreamWriter]:
    """A source file of `data` and a writer of one uint8 tensor as long."""
    (tmp_path / "src.bin").write_bytes(data)
    storage = Storage()
    source = storage.open_source(str(tmp_path / "src.bin"))
    writer = SafetensorsStreamWriter(
        storage.open_sink(str(tmp_path / "o.safetensors")),
        [HeaderEntry("t", "uint8", (len(data),))],
    )
    return source, writer


def test_ledger_gets_crc_of_every_range(tmp_path: Path, mode: CopyPolicy) -> None:
    import zlib

    data = bytes(range(256)) * 100
    source, writer = _uint8_file(tmp_path, data)
    ledger = CrcLedger()
    copy_stream(
        [CopyJob(0, source, 0, len(data), "uint8", "uint8", "rec", 0)],
        writer,
        chunk_bytes=1000,
        ledger=ledger,
        copy=mode,
    )
    writer.finish()
    assert ledger.check({"rec": (len(data), zlib.crc32(data))}).checked == ["rec"]


def test_read_error_aborts_cleanly(tmp_path: Path, mode: CopyPolicy) -> None:
    (tmp_path / "src.bin").write_bytes(b"\x00" * 100)
    storage = Storage()
    source = storage.open_source(str(tmp_path / "src.bin"))
    out = tmp_path / "o.safetensors"
    writer = SafetensorsStreamWriter(
        storage.open_sink(str(out)), [HeaderEntry("t", "uint8", (200,))]
    )
    with pytest.raises(Exception, match="truncated"):
        copy_stream(
            [CopyJob(0, source, 0, 200, "uint8", "uint8")], writer, chunk_bytes=64, copy=mode
        )
    writer.abort()
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src.bin"]


def test_ledger_runs_records_across_jobs_in_any_order(tmp_path: Path, mode: CopyPolicy) -> None:
    """A record read in pieces, out of order and around another record, checks whole."""
    import zlib

    data = bytes((i * 7 + i // 251) % 256 for i in range(100_000))
    source, writer = _uint8_file(tmp_path, data)
    ledger = CrcLedger()
    jobs = [
        CopyJob(0, source, 25_000, 20_000, "uint8", "uint8", "a", 25_000),
        CopyJob(0, source, 45_000, 15_000, "uint8", "uint8", "a", 45_000),
        CopyJob(0, source, 60_000, 40_000, "uint8", "uint8", "b", 0),
        CopyJob(0, source, 0, 25_000, "uint8", "uint8", "a", 0),
    ]
    copy_stream(jobs, writer, chunk_bytes=3000, ledger=ledger, copy=mode)
    writer.finish()
    check = ledger.check(
        {"a": (60_000, zlib.crc32(data[:60_000])), "b": (40_000, zlib.crc32(data[60_000:]))}
    )
    assert sorted(check.checked) == ["a", "b"] and not check.failed
    out = (tmp_path / "o.safetensors").read_bytes()
    assert out.endswith(data[25_000:] + data[:25_000])


def test_copy_mode_follows_tasks_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's `CopyPolicy` decides, not a setting of the process: `ZEROSAFE_COPY=fast`
    in the environment changes nothing here (the command and the flow read it)."""
    monkeypatch.setattr(streaming, "usable_cores", lambda: 16)
    monkeypatch.setenv("ZEROSAFE_COPY", "fast")
    # one unit on 16 cores: the pipeline's threads help
    assert copy_mode(CopyPolicy()) == "pipeline"
    # half the cores or more: the cheaper loop per byte
    assert copy_mode(CopyPolicy(tasks_at_once=8)) == "fused"
    assert copy_mode(CopyPolicy("pipeline", tasks_at_once=8)) == "pipeline"
    assert copy_mode(CopyPolicy("fused")) == "fused"
    with pytest.raises(ConfigError, match="ZEROSAFE_COPY='fast': expected one of auto, fused"):
        CopyPolicy("fast")


def test_a_cold_source_is_copied_by_the_pipeline(tmp_path: Path) -> None:
    """Fused only from the page cache: from a cold disk the pipeline's readers are faster."""
    import os

    from bench._iolimit import drop_cache
    from zerosafe.io.residency import cached_fraction
    from zerosafe.stages.streaming import fusable

    source, writer = _uint8_file(tmp_path, os.urandom(4 << 20))
    path = tmp_path / "src.bin"
    jobs = [CopyJob(0, source, 0, 4 << 20, "uint8", "uint8")]
    drop_cache([str(path)])
    cached = cached_fraction([(str(path), 0, 4 << 20)])
    if cached is None or cached > 0.5:
        pytest.skip("this kernel or file system cannot evict or count cached pages")
    assert not fusable(jobs, writer)
    # A caller that chose fused (a merge's streams) is not overruled by a second look at the
    # page cache, which may have changed: its buffers are sized for the fused loop only.
    assert streaming._fused(jobs, writer, True, None) and not streaming._fused(
        jobs, writer, None, None
    )
    path.read_bytes()
    assert fusable(jobs, writer)
    writer.abort()
