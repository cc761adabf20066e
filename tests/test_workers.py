"""Units in worker processes (`zerosafe.stages.workers`): the same bytes as threads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SAMPLE_CKPT
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import ConfigError
from zerosafe.stages.workers import PROCESS_MIN_BYTES, process_options


def _weights(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def test_processes_write_the_bytes_threads_write(tmp_path: Path, monkeypatch) -> None:
    import zerosafe.driver as driver
    from zerosafe.stages.workers import UnitPool

    pools: list[int] = []

    class CountedPool(UnitPool):  # the real pool, counted: the processes path did run
        def __init__(self, workers: int, shared: dict | None = None) -> None:
            pools.append(workers)
            super().__init__(workers, shared)

    monkeypatch.setattr(driver, "UnitPool", CountedPool)
    options = ConvertOptions(dtype="bf16", max_shard_size=4096, direct=True)
    outs = {}
    for mode in ("threads", "processes"):
        monkeypatch.setenv("ZEROSAFE_WORKERS", mode)
        outs[mode] = tmp_path / mode
        summary = convert_checkpoint(str(SAMPLE_CKPT), str(outs[mode]), options)
        assert summary.status == "converted"
    weights = _weights(outs["threads"])
    assert len(weights) >= 2
    assert _weights(outs["processes"]) == weights
    assert pools == [2]


def test_process_options_divides_the_budget(monkeypatch) -> None:
    monkeypatch.delenv("ZEROSAFE_WORKERS", raising=False)
    options = ConvertOptions(memory=2 * 10**9, max_parallel_tasks=2)
    assert process_options(options, units=4, nbytes=PROCESS_MIN_BYTES) is None  # threads by default
    monkeypatch.setenv("ZEROSAFE_WORKERS", "auto")
    assert process_options(options, units=4, nbytes=PROCESS_MIN_BYTES - 1) is None
    assert process_options(options, units=1, nbytes=PROCESS_MIN_BYTES) is None
    chosen = process_options(options, units=4, nbytes=PROCESS_MIN_BYTES)
    assert chosen is not None and chosen.parallel_tasks == 2
    assert chosen.memory < options.memory
    monkeypatch.setenv("ZEROSAFE_WORKERS", "threads")
    assert process_options(options, units=4, nbytes=PROCESS_MIN_BYTES) is None
    monkeypatch.setenv("ZEROSAFE_WORKERS", "bogus")
    with pytest.raises(ConfigError):
        process_options(options, units=4, nbytes=PROCESS_MIN_BYTES)
