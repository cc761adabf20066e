"""Progress on long work: a one-line terminal bar with bytes, throughput and time left.

The engine reports bytes through `Progress.advance`; the CLI picks `TerminalProgress` on a
terminal and `NullProgress` otherwise (or with `-q`). Safe to call from several threads.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Protocol, TextIO

from zerosafe.units import format_bytes

__all__ = ["NullProgress", "Progress", "TerminalProgress"]


class Progress(Protocol):
    def start(self, label: str, total_bytes: int, stages: dict[str, int] | None = None) -> None:
        """Begin a bar of `total_bytes`; `stages` splits it by stage (each stage's bytes)."""

    def advance(self, num_bytes: int, stage: str | None = None) -> None: ...

    def finish(self) -> None: ...


class NullProgress:
    def start(self, label: str, total_bytes: int, stages: dict[str, int] | None = None) -> None:
        pass

    def advance(self, num_bytes: int, stage: str | None = None) -> None:
        pass

    def finish(self) -> None:
        pass


class TerminalProgress:
    """Redraws one line on `stream` at most `refresh_hz` times a second.

    With `stages`, the line shows each stage's own bytes done of its total (`extract 40% of
    1.2 GB`), not one sum of unlike figures.
    """

    def __init__(self, stream: TextIO | None = None, refresh_hz: float = 8.0) -> None:
        self._stream = stream or sys.stderr
        self._interval = 1.0 / refresh_hz
        self._lock = threading.Lock()
        self._label = ""
        self._total = 0
        self._done = 0
        self._stages: dict[str, list[int]] = {}
        self._started = 0.0
        self._last_draw = 0.0

    def start(self, label: str, total_bytes: int, stages: dict[str, int] | None = None) -> None:
        with self._lock:
            self._label, self._total, self._done = label, total_bytes, 0
            self._stages = {k: [0, v] for k, v in (stages or {}).items() if v > 0}
            self._started = time.monotonic()
            self._draw(force=True)

    def advance(self, num_bytes: int, stage: str | None = None) -> None:
        with self._lock:
            self._done += num_bytes
            if stage in self._stages:
                self._stages[stage][0] += num_bytes
            self._draw()

    def finish(self) -> None:
        with self._lock:
            self._draw(force=True)
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < self._interval:
            return
        self._last_draw = now
        elapsed = max(now - self._started, 1e-9)
        rate = self._done / elapsed
        frac = self._done / self._total if self._total else 1.0
        width = 24
        filled = int(width * min(frac, 1.0))
        eta = (self._total - self._done) / rate if rate > 0 and self._total else 0.0
        if self._stages:
            figures = "  ".join(
                f"{name} {100 * min(done / total, 1.0):3.0f}% of {format_bytes(total)}"
                for name, (done, total) in self._stages.items()
            )
        else:
            figures = f"{format_bytes(self._done)}/{format_bytes(self._total)}"
        line = (
            f"\r{self._label:<8} [{'#' * filled}{'.' * (width - filled)}] {frac * 100:5.1f}% "
            f"{figures}  {format_bytes(rate)}/s ETA {int(eta) // 60}:{int(eta) % 60:02d}"
        )
        self._stream.write(line)
        self._stream.flush()
