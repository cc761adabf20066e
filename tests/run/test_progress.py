"""The terminal bar labels each stage's bytes instead of one sum of unlike figures."""

from __future__ import annotations

import io

from zerosafe.run.progress import TerminalProgress


def test_each_stage_is_shown_with_its_own_total() -> None:
    out = io.StringIO()
    bar = TerminalProgress(stream=out, refresh_hz=1e9)
    bar.start("convert", 600, stages={"extract": 100, "merge": 200, "verify": 300, "none": 0})
    bar.advance(100, stage="extract")
    bar.advance(50, stage="merge")
    bar.finish()
    last = out.getvalue().strip().split("\r")[-1]
    assert "extract 100% of 100 B" in last and "merge  25% of 200 B" in last
    assert "verify   0% of 300 B" in last and "none" not in last
    assert " 25.0% " in last  # 150 of 600 bytes overall


def test_without_stages_the_bar_shows_bytes_done_of_total() -> None:
    out = io.StringIO()
    bar = TerminalProgress(stream=out, refresh_hz=1e9)
    bar.start("merge", 1000)
    bar.advance(250)
    bar.finish()
    assert "250 B/1.00 KB" in out.getvalue().split("\r")[-1]
