"""Only the pickles and the fp32 masters are read: never the Adam moments."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SAMPLE_CKPT
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.formats.deepspeed.checkpoint import build_plan, open_zero_checkpoint
from zerosafe.io.storage import Storage


@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
def test_source_bytes_read_are_masters_plus_pickles(tmp_path: Path, direct: bool) -> None:
    storage = Storage()
    ckpt = open_zero_checkpoint(storage, str(SAMPLE_CKPT))
    plan = build_plan(ckpt, ConvertOptions())
    metadata_bytes = storage.counter.bytes_read_from(
        {f.url for f in plan.files}
    )  # pickles, directories
    needed = plan.slot_bytes + metadata_bytes
    checkpoint_bytes = plan.source.checkpoint_bytes

    run = Storage()
    summary = convert_checkpoint(
        str(SAMPLE_CKPT), str(tmp_path / "out"), ConvertOptions(direct=direct), storage=run
    )
    read = summary.stats.source_bytes_read
    print(
        f"\n{'direct' if direct else 'staged'}: read {read} B of the {checkpoint_bytes} B checkpoint "
        f"({read / checkpoint_bytes:.1%}); fp32 masters {plan.fp32_bytes} B, frozen+buffers "
        f"{plan.slot_bytes - plan.fp32_bytes} B, pickles+directories {metadata_bytes} B; ratio {read / needed:.4f}"
    )
    assert needed <= read <= 1.05 * needed
    assert read < 0.5 * checkpoint_bytes  # the moments are two thirds of every optimizer file
